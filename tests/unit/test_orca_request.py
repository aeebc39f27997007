"""The routing answer asks upstreams for ORCA load reports only when they will be read."""

from __future__ import annotations

from extproc.core.load import ORCA_FORMAT_HEADER
from extproc.protocol.responses import RouteAnswers
from tests.unit.test_admission import facts, fleet


def _set_headers(ask: bool) -> dict[str, str]:
    rt = fleet()
    f = facts(100)
    answer = RouteAnswers().route(rt.policy.route(f), f, ask)
    sets = answer.request_body.response.header_mutation.set_headers
    return {h.header.key: h.header.raw_value.decode() for h in sets}


def test_asks_for_text_reports_when_reading_them() -> None:
    assert _set_headers(True)[ORCA_FORMAT_HEADER] == "TEXT"


def test_does_not_ask_otherwise() -> None:
    assert ORCA_FORMAT_HEADER not in _set_headers(False)
