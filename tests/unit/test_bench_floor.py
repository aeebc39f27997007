"""The header path's floor in `bench overhead`: the bare processor answering at the headers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.bench import overhead
from extproc.bench.bare import bare_process

PM = processing_mode_pb2.ProcessingMode


async def _answers(header_path: bool, messages: list[ep.ProcessingRequest]) -> list[Any]:
    read: list[ep.ProcessingRequest] = []

    async def requests() -> AsyncIterator[ep.ProcessingRequest]:
        for m in messages:
            read.append(m)
            yield m

    out = [a async for a in bare_process("c1__c2", header_path)(requests(), None)]
    assert len(read) == (1 if header_path else len(messages))
    return out


async def test_the_bare_header_path_routes_at_the_headers_and_ends_the_stream() -> None:
    headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    (answer,) = await _answers(True, [headers, body])  # the body is never read
    common = answer.request_headers.response
    assert common.clear_route_cache
    assert [h.header.key for h in common.header_mutation.set_headers] == ["x-fleet-route"]
    assert answer.mode_override.request_body_mode == PM.NONE
    first, second = await _answers(False, [headers, body])
    assert not first.request_headers.HasField("response")
    assert second.request_body.response.clear_route_cache


def _result(setup: str, rps: float, p50: float, cpu: float | None) -> overhead.WrkResult:
    return overhead.WrkResult(setup, "1KB", 16, 1000, rps, p50, p50 * 2, 0, cpu)


def test_the_summary_sets_the_header_path_beside_its_floor() -> None:
    results = [
        _result("envoy", 5000.0, 2.0, None),
        _result("bare", 900.0, 15.0, 700.0),
        _result("header", 800.0, 17.0, 800.0),
        _result(overhead.BARE_HEADER, 1600.0, 9.0, 400.0),
    ]
    lines = overhead.summarize(results)
    assert "| 1KB | 16 | 7.000 / 15.000 | 0.32 / 0.16 | 400 / 800 | 2.00 |" in lines
    assert overhead._header_floor({}) == []
