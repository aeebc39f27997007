"""A loopback TCP proxy the chaos run puts between the processors and Redis.

Modes: ``pass`` (forward), ``delay`` (hold every chunk ``delay_s`` before forwarding: a slow
Redis or a slow network), ``blackhole`` (accept and read, forward nothing: a partition where
packets vanish, the nastiest kind, because clients only learn of it by timing out). Leaving
``blackhole`` closes the connections it swallowed data on, so clients reconnect to a clean
stream instead of waiting for replies that were never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

Mode = Literal["pass", "delay", "blackhole"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float = 0.2) -> None:
        self.target = (target_host, target_port)
        self.mode: Mode = "pass"
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "127.0.0.1") -> None:
        self._server = await asyncio.start_server(self._accept, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def set_mode(self, mode: Mode) -> None:
        was, self.mode = self.mode, mode
        if was == "blackhole" and mode != "blackhole":
            self.drop_all()

    def drop_all(self) -> None:
        for client, upstream in list(self._conns):
            client.close()
            upstream.close()
        self._conns.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_all()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()  # Redis is down: the client sees a refused/closed connection
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst, pair))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            # One side going away ends both directions, as a real network path would.
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    data = await src.read(1 << 16)
                    if not data:
                        break
                    if self.mode == "blackhole":
                        continue
                    if self.mode == "delay":
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.close()
