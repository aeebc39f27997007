"""A minimal HTTP/2 (cleartext, prior knowledge) client that can send request trailers.

The HTTP client libraries in the dev dependencies cannot send request trailers; gRPC-style and
other HTTP/2 clients can, and Envoy then delivers a BUFFERED body to ext_proc with
end_of_stream=false followed by a trailers message. Built on the ``h2`` protocol library over a
plain socket, one request per connection.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass(frozen=True, slots=True)
class H2Response:
    status: int
    headers: dict[str, str]
    body: bytes
    reset: bool  # the stream ended with RST_STREAM instead of END_STREAM


def h2_post(
    port: int,
    path: str,
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
    trailers: Sequence[tuple[str, str]] = (),
    timeout: float = 30.0,
    host: str = "127.0.0.1",
) -> H2Response:
    """POST ``body`` (may be empty: then only headers and trailers are sent) with ``trailers``
    (none: the body ends the stream) and read the whole response."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((host, port), timeout=timeout) as sock:
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        sid = conn.get_next_available_stream_id()
        request_headers = [
            (":method", "POST"),
            (":path", path),
            (":scheme", "http"),
            (":authority", f"{host}:{port}"),
            ("content-type", "application/json"),
            *headers,
        ]
        conn.send_headers(sid, request_headers, end_stream=not body and not trailers)
        sock.sendall(conn.data_to_send())
        sent = 0
        events: list[h2.events.Event] = []
        while sent < len(body):
            room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            if room <= 0:
                # Wait for Envoy's WINDOW_UPDATE; keep whatever else arrives meanwhile.
                events += _read(sock, conn)
                continue
            chunk = body[sent : sent + room]
            sent += len(chunk)
            try:
                conn.send_data(sid, chunk, end_stream=sent == len(body) and not trailers)
            except h2.exceptions.StreamClosedError:
                break  # Envoy answered (and reset the stream) before the body was all sent
            sock.sendall(conn.data_to_send())
        if trailers and sent == len(body):
            conn.send_headers(sid, list(trailers), end_stream=True)
            sock.sendall(conn.data_to_send())
        status = 0
        response_headers: dict[str, str] = {}
        data = bytearray()
        while True:
            for event in events:
                if isinstance(event, h2.events.ResponseReceived):
                    response_headers = {
                        _text(k): _text(v) for k, v in event.headers if _text(k) != ":status"
                    }
                    status = int(dict((_text(k), _text(v)) for k, v in event.headers)[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == sid:
                    return H2Response(status, response_headers, bytes(data), reset=False)
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == sid:
                    return H2Response(status, response_headers, bytes(data), reset=True)
            sock.sendall(conn.data_to_send())
            events = _read(sock, conn)


def _read(sock: socket.socket, conn: h2.connection.H2Connection) -> list[h2.events.Event]:
    raw = sock.recv(1 << 16)
    if not raw:
        raise ConnectionError("connection closed before the response ended")
    events = conn.receive_data(raw)
    sock.sendall(conn.data_to_send())
    return list(events)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
