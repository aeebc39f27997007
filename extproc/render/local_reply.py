"""Envoy's own error answers (local replies) as JSON errors both SDK families can read.

Without this, a request Envoy refuses before the processor decides anything gets Envoy's
``text/plain`` body, which OpenAI and Anthropic SDKs report as an unparseable error:

- a malformed or oversized header block (400 ``http1.invalid_characters``, 431
  ``http1.too_many_headers`` / ``http1.headers_too_large``): the codec rejects it before a
  request exists, so there is no ``:path`` to tell the API by;
- a malformed trailer block or chunk framing after a well-formed request (400 ``http1.*``):
  matched by its response code details, because its DPE flag is set too late;
- no healthy upstream (503, flag UH), an upstream unreachable or reset before answering (503,
  UF/URX/UC), an overflowing circuit breaker (UO), an upstream timeout (504, UT), no route (NR),
  a stream idle timeout (SI), a downstream protocol error (DPE);
- any other error Envoy writes itself (413 for a body over the buffer limit, 408 at the request
  timeout): every answer of the processor carries response code details that start with
  ``IMMEDIATE_DETAILS_PREFIX``, anything else with a status of 400 or more is Envoy's.

The mapper selects those by response flag, by codec details, or by "no request headers at
all", so the processor's own immediate responses (no flag, a ``:path``; already JSON in the
API's format) pass through untouched. A 503 of no reachable upstream (UH, UF, UO, URX: every
engine of the request's clusters down, unreachable or full, e.g. all of a model's clusters
down before any probe or reload has taken them out) also gets a ``retry-after`` header, the
same hint as the processor's own 503 for a model with nowhere to go
(``model_routing.unavailable_retry_after_s``): the SDKs honour it when they retry. One body
shape serves both APIs: OpenAI's ``{"error": {"message",
"type", "code"}}`` plus Anthropic's top-level ``"type": "error"`` (Anthropic's error object has
the same ``type`` and ``message``), because a codec error has no path to choose a shape by.
"""

from __future__ import annotations

from typing import Any

from extproc.names import IMMEDIATE_DETAILS_PREFIX

# Response flags of replies Envoy generates itself (not the processor, not an upstream).
ENVOY_REPLY_FLAGS = ("DPE", "UH", "UF", "UO", "URX", "UC", "UT", "NR", "SI", "DC", "LR")

CEL_FILTER_TYPE = (
    "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
)
# Response code details of the HTTP codecs' own errors.
CODEC_DETAIL_PREFIXES = ("http1.", "http2.", "http3.")

ERROR_SHAPE = {
    "type": "error",
    "error": {
        "type": "gateway_error",
        "message": "%LOCAL_REPLY_BODY%",
        "code": "%RESPONSE_CODE_DETAILS%",
    },
}


# Envoy's 503s that say no upstream could take the request now (none healthy, connection
# refused, circuit breaker full, retries spent): worth a retry after a while. Not UC or UT (an
# upstream that had the request: a retry may generate twice, the client decides unprompted).
NO_UPSTREAM_FLAGS = ("UH", "UF", "UO", "URX")


def local_reply_config(retry_after_s: int = 5) -> dict[str, Any]:
    by_flag = {"response_flag_filter": {"flags": list(ENVOY_REPLY_FLAGS)}}
    no_upstream = {
        "and_filter": {
            "filters": [
                {
                    "status_code_filter": {
                        "comparison": {
                            "op": "EQ",
                            "value": {"default_value": 503, "runtime_key": "fleet.local_503"},
                        }
                    }
                },
                {"response_flag_filter": {"flags": list(NO_UPSTREAM_FLAGS)}},
            ]
        }
    }
    json_body = {"json_format": ERROR_SHAPE, "content_type": "application/json"}
    error_status = {
        "status_code_filter": {
            "comparison": {
                "op": "GE",
                "value": {"default_value": 400, "runtime_key": "fleet.local_reply"},
            }
        }
    }
    codec_error = {
        "and_filter": {
            "filters": [
                error_status,
                # No :path: the header block never became a request (a codec error).
                {"header_filter": {"header": {"name": ":path", "present_match": False}}},
            ]
        }
    }
    # A codec error after the request exists (a malformed trailer block, a bad chunk): it has a
    # :path, and Envoy sets DPE only when it then closes the connection, after the reply has
    # been mapped. Its response code details ("http1.invalid_characters", ...) are set before
    # the mapper runs, and only the codecs use these prefixes.
    codec_details = {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": CEL_FILTER_TYPE,
                "expression": " || ".join(
                    f"response.code_details.startsWith('{p}')" for p in CODEC_DETAIL_PREFIXES
                ),
            },
        }
    }
    # Any other error Envoy writes itself, with a request and no flag: 413 when a buffered body
    # outgrows the buffer limit ("request_payload_too_large"), 408 at the request timeout, ...
    # The processor's own answers carry details with IMMEDIATE_DETAILS_PREFIX and pass as
    # they are (already JSON in the API's format).
    not_the_processors = {
        "and_filter": {
            "filters": [
                error_status,
                {
                    "extension_filter": {
                        "name": "envoy.access_loggers.extension_filters.cel",
                        "typed_config": {
                            "@type": CEL_FILTER_TYPE,
                            "expression": (
                                f"!response.code_details.startsWith('{IMMEDIATE_DETAILS_PREFIX}')"
                            ),
                        },
                    }
                },
            ]
        }
    }
    filters = [by_flag, codec_error, codec_details, not_the_processors]
    # The first mapper whose filter matches applies: the retry hint's before the general one.
    return {
        "mappers": [
            {
                "filter": no_upstream,
                "headers_to_add": [
                    {
                        "header": {"key": "retry-after", "value": str(retry_after_s)},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ],
                "body_format_override": json_body,
            },
            {
                "filter": {"or_filter": {"filters": filters}},
                "body_format_override": json_body,
            },
        ]
    }
