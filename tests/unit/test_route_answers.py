"""RouteAnswers copies a cached routing part into each answer: answers stay per request."""

from __future__ import annotations

from extproc.names import (
    CLASS_HEADER,
    PRIMARY_HEADER,
    ROUTE_HEADER,
    SECONDARY_HEADER,
    SESSION_HEADER,
)
from extproc.protocol.responses import SKIP_REQUEST_BODY, RouteAnswers
from tests.unit.test_admission import facts, fleet


def _pairs(answer_common: object) -> list[tuple[str, str]]:
    sets = answer_common.header_mutation.set_headers  # type: ignore[attr-defined]
    return [(h.header.key, h.header.raw_value.decode()) for h in sets]


def test_two_sessions_on_one_route_get_their_own_labels_and_the_shared_routing_headers() -> None:
    rt = fleet()
    answers = RouteAnswers()
    first, second = facts(100, session="a"), facts(100, session="b")
    route = rt.policy.route(first)
    one = answers.route(route, first).request_body.response
    two = answers.route(route, second).request_body.response
    placement = route.placement
    shared = [
        (ROUTE_HEADER, placement.route),
        (PRIMARY_HEADER, placement.primary),
        (SECONDARY_HEADER, placement.secondary or placement.primary),
        (CLASS_HEADER, route.request_class.name),
    ]
    assert _pairs(one) == [*shared, (SESSION_HEADER, first.session.label)]
    assert _pairs(two) == [*shared, (SESSION_HEADER, second.session.label)]
    assert one.clear_route_cache and two.clear_route_cache
    # A third answer after the first two: nothing a request added stayed in the shared part.
    three = answers.route(route, first, engine_key="k1").request_body.response
    assert len(three.header_mutation.set_headers) == 6
    assert _pairs(answers.route(route, first).request_body.response) == _pairs(one)


def test_the_header_path_answer_carries_the_same_routing_part_on_the_headers_message() -> None:
    rt = fleet()
    f = facts(100)
    route = rt.policy.route(f)
    answers = RouteAnswers()
    body_answer = answers.route(route, f)
    header_answer = answers.route(route, f, skip_body=SKIP_REQUEST_BODY[False, False])
    assert header_answer.WhichOneof("response") == "request_headers"
    assert header_answer.mode_override == SKIP_REQUEST_BODY[False, False]
    assert _pairs(header_answer.request_headers.response) == _pairs(
        body_answer.request_body.response
    )


def test_the_cache_is_bounded() -> None:
    answers = RouteAnswers(max_entries=2)
    for name in ("a", "b", "c", "d", "e"):
        common = answers._common(f"{name}__x", name, "x", "short")
        assert [h.header.raw_value for h in common.header_mutation.set_headers][:2] == [
            f"{name}__x".encode(),
            name.encode(),
        ]
        assert len(answers._commons) <= 2
