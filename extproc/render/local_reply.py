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
  a stream idle timeout (SI), a downstream protocol error (DPE).

The mapper selects those by response flag, by codec details, or by "no request headers at
all", so the
processor's own immediate responses (no flag, a ``:path``; already JSON in the API's format)
pass through untouched. One body shape serves both APIs: OpenAI's ``{"error": {"message",
"type", "code"}}`` plus Anthropic's top-level ``"type": "error"`` (Anthropic's error object has
the same ``type`` and ``message``), because a codec error has no path to choose a shape by.
"""

from __future__ import annotations

from typing import Any

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


def local_reply_config() -> dict[str, Any]:
    by_flag = {"response_flag_filter": {"flags": list(ENVOY_REPLY_FLAGS)}}
    codec_error = {
        "and_filter": {
            "filters": [
                {
                    "status_code_filter": {
                        "comparison": {
                            "op": "GE",
                            "value": {"default_value": 400, "runtime_key": "fleet.local_reply"},
                        }
                    }
                },
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
    return {
        "mappers": [
            {
                "filter": {"or_filter": {"filters": [by_flag, codec_error, codec_details]}},
                "body_format_override": {
                    "json_format": ERROR_SHAPE,
                    "content_type": "application/json",
                },
            }
        ]
    }
