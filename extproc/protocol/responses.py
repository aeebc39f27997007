"""The ONE place that turns decisions into Envoy ext_proc messages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.core.admission import Reject
from extproc.core.api import BadRequest, ErrorStyle
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.load import ORCA_FORMAT, ORCA_FORMAT_HEADER
from extproc.core.models import ModelUnavailable
from extproc.core.ratelimit_headers import rate_limit_headers
from extproc.names import (
    CLASS_HEADER,
    ENGINE_KEY_HEADER,
    EVERY_ENDPOINT_CLUSTER,
    IMMEDIATE_DETAILS_PREFIX,
    PREFILL_MIRROR_HEADER,
    PREFILLER_HEADER,
    PRIMARY_HEADER,
    ROUTE_HEADER,
    SECONDARY_HEADER,
    SESSION_HEADER,
    WAIT_TIMER_HEADROOM_S,
)
from extproc.protocol.errors import error_body

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Answers that carry no decision are immutable: build them once.
CONTINUE_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
CONTINUE_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
CONTINUE_RESPONSE_HEADERS = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
CONTINUE_RESPONSE_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def _observing(response_body: bool) -> ep.ProcessingResponse:
    mode = processing_mode_pb2.ProcessingMode
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(),
        # Every field explicit: Envoy takes both body modes from an override whatever they
        # say, and older Envoys read a DEFAULT header or trailer mode as "send" / "skip"
        # rather than "no change". The request's own modes are the rendered ones.
        mode_override=mode(
            request_header_mode=mode.SEND,
            request_body_mode=mode.BUFFERED,
            request_trailer_mode=mode.SEND,
            response_header_mode=mode.SEND,
            response_body_mode=mode.BUFFERED if response_body else mode.NONE,
            response_trailer_mode=mode.SKIP,
        ),
    )


# The request-headers answer to an inference request whose response the processor reads: the
# rendered filter skips response phases (extproc/render/envoy.py), and this turns them on for
# this request only (the filter's allow_mode_override).
OBSERVE_RESPONSE_HEADERS = _observing(response_body=False)
OBSERVE_RESPONSES = _observing(response_body=True)


# The request-headers answer to a chunked HTTP/1.1 upload whose response the processor would
# read. Such a request can still fail in Envoy's codec after its headers (a malformed chunk or
# trailer block), and Envoy's own answer to that error then runs through the filter's response
# phases while the connection manager closes the connection at once: with response headers
# SEND, the answer waits on the processor and the client gets none (Envoy issue 29440;
# RELIABILITY.md). So no response phase Envoy's answer would wait on: response
# trailers SEND only keeps the stream, and with it the request's budget, until the exchange
# ends (as on the header path), and Envoy's answer has no trailers.
OBSERVE_CHUNKED_UPLOAD = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_header_mode=processing_mode_pb2.ProcessingMode.SEND,
        request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
        request_trailer_mode=processing_mode_pb2.ProcessingMode.SEND,
        response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
        response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        response_trailer_mode=processing_mode_pb2.ProcessingMode.SEND,
    ),
)


def continue_inference_headers(
    response_headers: bool, response_body: bool, chunked: bool = False
) -> ep.ProcessingResponse:
    """The answer to an inference request's headers while its body is awaited (``chunked``:
    an HTTP/1.1 chunked upload, see OBSERVE_CHUNKED_UPLOAD)."""
    if not response_headers:
        return CONTINUE_HEADERS
    if chunked:
        return OBSERVE_CHUNKED_UPLOAD
    return OBSERVE_RESPONSES if response_body else OBSERVE_RESPONSE_HEADERS


# Streams must keep streaming while their usage is read: switch this response's body to
# STREAMED (the filter's default for inspected responses is BUFFERED, right for JSON answers).
STREAM_RESPONSE_HEADERS = ep.ProcessingResponse(
    response_headers=ep.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        response_body_mode=processing_mode_pb2.ProcessingMode.STREAMED
    ),
)


def extend_message_timeout(seconds: float) -> ep.ProcessingResponse:
    """A message that only re-arms Envoy's ext_proc message timer for ``seconds``.

    Sent while a request waits for budget (extproc/core/flow.py): the body message stays
    unanswered meanwhile, and the filter's ``message_timeout`` would otherwise end the wait
    (fail-open: the request would go unplaced). Envoy restarts the timer of the phase it
    waits on with this duration; it must not exceed the filter's ``max_message_timeout``
    (rendered in extproc/render/envoy.py), or Envoy ignores it. Verified on Envoy 1.40 by
    tests/e2e/test_flow.py (a 3 s wait under a 2 s message_timeout).
    """
    wanted = seconds + WAIT_TIMER_HEADROOM_S
    timeout = duration_pb2.Duration(seconds=int(wanted), nanos=int((wanted % 1) * 1e9))
    return ep.ProcessingResponse(override_message_timeout=timeout)


_PM = processing_mode_pb2.ProcessingMode


def _skip_request_body(
    response_headers: bool, response_body: bool
) -> processing_mode_pb2.ProcessingMode:
    # Envoy takes both body modes from an override whatever it says (a lone request_body_mode
    # NONE would also turn response_body_mode to NONE), so every mode is explicit: the
    # response phases the processor reads (Runtime.response_phases, as
    # continue_inference_headers asks for them on the body path). Trailers: Envoy 1.40 ends
    # the ext_proc stream as soon as it expects no further message
    # (ext_proc_stream_close_optimization), and the stream's end is when the processor gives
    # back the request's budget. Response trailers SEND keeps the stream for the whole
    # exchange at no cost (Envoy sends that message only for a response that has trailers).
    # tests/e2e/test_header_path.py holds a budget through a generation, JSON and SSE.
    return _PM(
        request_header_mode=_PM.SEND,
        request_body_mode=_PM.NONE,
        request_trailer_mode=_PM.SEND,
        response_header_mode=_PM.SEND if response_headers else _PM.SKIP,
        response_body_mode=_PM.BUFFERED if response_body else _PM.NONE,
        response_trailer_mode=_PM.SEND,
    )


# The header path's override, by (response phases read, response body read).
SKIP_REQUEST_BODY = {
    (headers, body): _skip_request_body(headers, body)
    for headers in (False, True)
    for body in (False, True)
}


def _request_answer(
    skip_body: processing_mode_pb2.ProcessingMode | None,
) -> tuple[ep.ProcessingResponse, ep.CommonResponse]:
    """The answer to the request-headers message (``skip_body``: the header path's override,
    the body never sent) or, without it, to the request-body message, and its CommonResponse
    to fill in place (a CommonResponse built apart is copied whole into the answer: about
    twice the cost of the answer, per request)."""
    if skip_body is None:
        answer = ep.ProcessingResponse()
        return answer, answer.request_body.response
    answer = ep.ProcessingResponse(mode_override=skip_body)
    return answer, answer.request_headers.response


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _add(sets: Any, key: str, value: str) -> None:
    """Append a set-header entry built in place (no message built apart and copied in)."""
    entry = sets.add()
    entry.header.key = key
    entry.header.raw_value = value.encode()
    entry.append_action = _OVERWRITE


class RouteAnswers:
    """Builds the body-phase routing answer, reusing the header entries that repeat.

    Route, primary, secondary and class values come from a set bounded by the config, so the
    CommonResponse that sets them (with clear_route_cache) is built once per combination and
    copied in whole: one copy of a built message costs about half of appending its four entries
    one by one (3.8 vs 6.8 µs per answer in process), and the answer is built for every routed
    request. Only the session label (and the engine key) are new each time. The caches are
    cleared when they outgrow ``max_entries`` (a reload that renamed clusters leaves stale
    entries behind).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._cache: dict[tuple[str, str], base_pb2.HeaderValueOption] = {}
        self._commons: dict[tuple[str, str, str, str], ep.CommonResponse] = {}
        self._max = max_entries

    def _entry(self, key: str, value: str) -> base_pb2.HeaderValueOption:
        entry = self._cache.get((key, value))
        if entry is None:
            if len(self._cache) >= self._max:
                self._cache.clear()
            entry = self._cache[(key, value)] = _set(key, value)
        return entry

    def _common(self, route: str, primary: str, secondary: str, cls: str) -> ep.CommonResponse:
        """The routing part every answer to this (route, primary, secondary, class) shares."""
        key = (route, primary, secondary, cls)
        common = self._commons.get(key)
        if common is None:
            if len(self._commons) >= self._max:
                self._commons.clear()
            common = self._commons[key] = ep.CommonResponse(clear_route_cache=True)
            common.header_mutation.set_headers.extend(
                (
                    self._entry(ROUTE_HEADER, route),
                    self._entry(PRIMARY_HEADER, primary),
                    self._entry(SECONDARY_HEADER, secondary),
                    self._entry(CLASS_HEADER, cls),
                )
            )
        return common

    def route(
        self,
        route: Route,
        facts: RequestFacts,
        ask_load_report: bool = False,
        prefiller: str | None = None,
        engine_key: str | None = None,
        skip_body: processing_mode_pb2.ProcessingMode | None = None,
        mirror: tuple[str, bytes] | None = None,
        engines: Sequence[str] = (),
    ) -> ep.ProcessingResponse:
        """Set routing headers and make Envoy re-pick the route.

        ``engines`` (route mode, a LoRA adapter's request): the engines to try in order, in the
        picker's ``envoy.lb`` metadata (:func:`_name_hosts`), and the route to the cluster of
        every endpoint, whose override_host policy reads them. Not the pair aggregate: on
        Envoy 1.40 the aggregate hands its member cluster a load-balancer context without the
        request's stream info, where override_host finds the names, so the member's hash
        chose (observed: sessions named to one engine were served by both of the cluster's).

        clear_route_cache is what makes the router re-evaluate `cluster_header: x-fleet-route`;
        it only works because the header phase was SENT (with SKIP, routing is already final).
        ``skip_body`` (one of SKIP_REQUEST_BODY): answer the headers message instead (the
        header path), and tell Envoy not to send the body.
        """
        placement = route.placement
        answer, common = _request_answer(skip_body)
        common.CopyFrom(
            self._common(
                EVERY_ENDPOINT_CLUSTER if engines else placement.route,
                placement.primary,
                placement.secondary or placement.primary,
                route.request_class.name,
            )
        )
        sets = common.header_mutation.set_headers
        _add(sets, SESSION_HEADER, facts.session.label)
        if engine_key is not None:
            # The route's hash_policy: Envoy's consistent hash keeps the session on one engine.
            _add(sets, ENGINE_KEY_HEADER, engine_key)
        if ask_load_report:
            # vLLM attaches its ORCA endpoint-load-metrics to a (non-streaming) response only
            # when the request asks for it.
            sets.append(self._entry(ORCA_FORMAT_HEADER, ORCA_FORMAT))
        if prefiller is not None:
            # P/D: the decode-side sidecar (llm-d) prefills there, then decodes locally.
            sets.append(self._entry(PREFILLER_HEADER, prefiller))
        if mirror is not None:
            _mirror_to_prefill(common, mirror)
        if engines:
            _name_hosts(answer, engines)
        return answer


def _mirror_to_prefill(common: ep.CommonResponse, mirror: tuple[str, bytes]) -> None:
    """SGLang's P/D protocol: the body with its bootstrap fields, for the decode target and,
    through the route's request mirror (the cluster named in the header), for the prefill
    endpoint. A body-phase answer only (the body is replaced whole, BUFFERED)."""
    cluster, body = mirror
    sets = common.header_mutation.set_headers
    _add(sets, PREFILL_MIRROR_HEADER, cluster)
    # The body changed length; the upstream reads exactly content-length bytes.
    _add(sets, "content-length", str(len(body)))
    common.body_mutation.body = body


# The Inference Extension's Endpoint Picker protocol: the header and the envoy.lb metadata key
# that Envoy's override_host load-balancing policy reads (one of the two is configured there).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"


def endpoint_response(
    route: Route,
    facts: RequestFacts,
    endpoints: Sequence[str],
    prefiller: str | None = None,
    skip_body: processing_mode_pb2.ProcessingMode | None = None,
    pool: str | None = None,
    mirror: tuple[str, bytes] | None = None,
) -> ep.ProcessingResponse:
    """Answer in endpoint-picker mode: the primary's endpoint, then the fallback (to the body
    message, or with ``skip_body`` to the headers message, as :meth:`RouteAnswers.route`).

    Without ``pool`` no clear_route_cache: the route (to the pool of every endpoint) is fixed;
    only the host choice changes. With ``pool`` (a model's own pool, model-aware fleets) the
    route header names it and clear_route_cache makes Envoy re-pick the route, as in route
    mode: the pool route (``x-fleet-route`` starting ``_pool_``) sends it there.
    """
    value = ",".join(endpoints)
    answer, common = _request_answer(skip_body)
    sets = common.header_mutation.set_headers
    if pool is not None:
        common.clear_route_cache = True
        _add(sets, ROUTE_HEADER, pool)
    _add(sets, DESTINATION_HEADER, value)
    _add(sets, PRIMARY_HEADER, route.placement.primary)
    _add(sets, CLASS_HEADER, route.request_class.name)
    _add(sets, SESSION_HEADER, facts.session.label)
    if prefiller is not None:
        _add(sets, PREFILLER_HEADER, prefiller)
    if mirror is not None:
        _mirror_to_prefill(common, mirror)
    _name_hosts(answer, endpoints)
    return answer


def _name_hosts(answer: ep.ProcessingResponse, hosts: Sequence[str]) -> None:
    """The hosts Envoy's override_host policy tries, in order (one more on each retry)."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: ",".join(hosts)}})
    answer.dynamic_metadata.CopyFrom(metadata)


def immediate(
    status: int, body: bytes, headers: Iterable[tuple[str, str]] = (), details: str = ""
) -> ep.ProcessingResponse:
    """Envoy answers the client itself; it adds only date, server and content-length."""
    if not details.startswith(IMMEDIATE_DETAILS_PREFIX):
        # Envoy's local reply mapper leaves only answers with this prefix alone.
        details = IMMEDIATE_DETAILS_PREFIX + (details or "answer")
    resp = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        body=body,
        details=details,
    )
    sets = resp.headers.set_headers
    sets.append(_set("content-type", "application/json"))
    for key, value in headers:
        sets.append(_set(key, value))
    return ep.ProcessingResponse(immediate_response=resp)


def bad_request_response(bad: BadRequest) -> ep.ProcessingResponse:
    return immediate(
        bad.status,
        error_body(bad.style, bad.status, bad.message, bad.error_type, bad.param),
        details=f"fleet_{bad.error_type}",
    )


def error_response(
    style: ErrorStyle, status: int, message: str, code: str, headers: Iterable[tuple[str, str]] = ()
) -> ep.ProcessingResponse:
    return immediate(status, error_body(style, status, message, code), headers, f"fleet_{code}")


def model_unavailable_response(miss: ModelUnavailable, style: ErrorStyle) -> ep.ProcessingResponse:
    """A known model with no cluster to serve it: 503 with the retry hint SDKs read (both
    retry 503 and honour retry-after / retry-after-ms, extproc.core.ratelimit_headers)."""
    hint = (
        ("retry-after", str(miss.retry_after_s)),
        ("retry-after-ms", str(miss.retry_after_s * 1000)),
    )
    return error_response(style, 503, miss.message, "model_unavailable", hint)


def reject_response(
    reject: Reject, style: ErrorStyle, wall_now: float | None = None
) -> ep.ProcessingResponse:
    """Over budget (429 with retry hints), never admissible (413) or ledger down (503).
    ``wall_now`` (Unix time) dates the resets of Anthropic's rate-limit headers."""
    body = error_body(style, reject.status, reject.message, reject.code)
    headers = rate_limit_headers(reject, style, wall_now)
    return immediate(reject.status, body, headers, f"fleet_{reject.reason}")
