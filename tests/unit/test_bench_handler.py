"""`bench handler --cold-bytes`: the evictor writes its memory, and the rows come out whole."""

from __future__ import annotations

import asyncio

import pytest

from extproc.bench import handler


def test_the_evictor_writes_one_byte_per_cache_line() -> None:
    evict = handler._Evictor(1 << 12)
    evict._buffer[:] = b"\x01" * (1 << 12)
    evict()
    assert evict._buffer[::64] == bytes(64)
    assert evict._buffer[1::64] == b"\x01" * 64  # the rest of each line is left alone


def test_cold_rows_measure_both_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(handler.REQUESTS, "1KB", 30)
    rows = asyncio.run(handler._handler_rows(["1KB"], 1, None, "always", cold_bytes=1 << 16))
    (row,) = rows
    assert row["size"] == "1KB"
    assert row["bare_us"] > 0 and row["extproc_us"] > 0
    assert row["added_us"] == pytest.approx(row["extproc_us"] - row["bare_us"], abs=0.2)
