"""The chaos run's loopback TCP proxy: forwards, delays, and swallows (a partition)."""

from __future__ import annotations

import asyncio
import time

import pytest

from extproc.reliability.tcp_proxy import TcpProxy


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _roundtrip(port: int, wait_s: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.read(4), wait_s)
    finally:
        writer.close()


async def test_pass_delay_and_blackhole() -> None:
    server = await _echo_server()
    proxy = TcpProxy("127.0.0.1", server.sockets[0].getsockname()[1], delay_s=0.2)
    await proxy.start()
    try:
        assert await _roundtrip(proxy.port, 5) == b"ping"
        proxy.set_mode("delay")
        started = time.monotonic()
        assert await _roundtrip(proxy.port, 5) == b"ping"
        assert time.monotonic() - started >= 0.35  # held once each way
        proxy.set_mode("blackhole")
        with pytest.raises(TimeoutError):
            await _roundtrip(proxy.port, 0.5)
        proxy.set_mode("pass")
        assert await _roundtrip(proxy.port, 5) == b"ping"
    finally:
        await proxy.close()
        server.close()
