"""Edge limits through a real Envoy: slow clients fill the connection limit, yet normal requests
keep being served.

- the global downstream connection limit (overload manager) closes connections beyond it at
  accept, so slow clients cannot exhaust memory or file descriptors;
- a client on an established keep-alive connection is served while the edge is full;
- the request-receive timeouts (request_timeout, request_headers_timeout) end each slow upload
  (Envoy counts which timer did), which frees its connection for a new client.
Small values stand in for the defaults (10 000 connections, 120 s / 10 s). Nothing is asserted
on how fast: every wait is on a condition, bounded against a hang only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import h2.config
import h2.connection
import h2.events
import h2.settings
import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, Client, FleetStack, wait_until
from extproc.names import BUFFER_HEADROOM
from tests.e2e.predict import placement_for

CHAT = "/v1/chat/completions"
MAX_CONNECTIONS = 8
RECEIVE_TIMEOUT_S = 2.0
HEADERS_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 4 << 20
# How long a step may take before the test calls it hung: generous, for a starved machine.
HANG_S = 60.0
# Envoy's counters of requests its receive timers ended (stat_prefix "ingress").
BODY_TIMEOUTS = "http.ingress.downstream_rq_timeout"
HEADER_TIMEOUTS = "http.ingress.downstream_rq_header_timeout"


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("edge-limits"),
        clusters=1,
        fleet_overrides={
            "listener": {
                "max_connections": MAX_CONNECTIONS,
                "request_receive_timeout_s": RECEIVE_TIMEOUT_S,
                "request_headers_timeout_s": HEADERS_TIMEOUT_S,
            },
            "processor": {"max_body_bytes": MAX_BODY_BYTES},
        },
    )
    with stack:
        yield stack


BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)


class SlowClient:
    """Sends a request a byte at a time: its headers (slow-header) or its body (slow-upload)."""

    def __init__(self, port: int, slow_headers: bool) -> None:
        self.sock = socket.create_connection((LOOPBACK, port), timeout=10)
        self.slow_headers = slow_headers
        self.answer = b""
        self.closed = threading.Event()  # Envoy ended the request (an answer, or a close)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
            f"content-length: 100000\r\n\r\n"
        ).encode()
        if self.slow_headers:
            pending = head
        else:
            self.sock.sendall(head)
            pending = b"{" + b" " * 99_999
        self.sock.settimeout(0.2)
        try:
            for byte in pending:
                if self._stop.is_set():
                    return
                self.sock.sendall(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    data = self.sock.recv(4096)
                    if not data:
                        break
                    self.answer += data
                    break
            else:
                return  # the whole request went out: no timer ended it
        except OSError:
            pass  # Envoy closed the connection: what the test waits for.
        self.closed.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


def _connection_is_refused(port: int) -> bool:
    """True when Envoy closes a new connection at once (the connection limit)."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
        sock.settimeout(2)
        try:
            sock.sendall(
                f"POST {CHAT} HTTP/1.1\r\nhost: edge\r\ncontent-length: 0\r\n\r\n".encode()
            )
            return sock.recv(1024) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def _hold(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that send nothing: no receive timer starts before a request's first
    byte, so they hold their place at the edge until they are closed."""
    return [socket.create_connection((LOOPBACK, port), timeout=10) for _ in range(n)]


def _fill_with(port: int, make: Callable[[], SlowClient]) -> SlowClient:
    """A slow client that is seen holding the edge's last connection: a further connection was
    refused while it was still open. A client whose timer ended it before that was seen (a
    slow machine) is replaced by a new one."""
    for _ in range(20):
        client = make()
        wait_until(
            lambda c=client: c.closed.is_set() or _connection_is_refused(port),
            HANG_S,
            "the slow client to fill the edge",
        )
        if not client.closed.is_set():
            return client
        client.stop()
    raise AssertionError("no slow client was ever seen holding the edge's last connection")


def test_slow_clients_at_the_connection_limit_do_not_starve_normal_requests(
    edge: FleetStack,
) -> None:
    port = edge.listener_port
    overflow = f"listener.127.0.0.1_{port}.downstream_global_cx_overflow"
    steady = Client(port)
    # The steady client's keep-alive connection exists before the edge fills up.
    assert steady.post_json(CHAT, BODY)[0] == 200
    overflow_before = edge.envoy_stat(overflow)
    holders = _hold(port, MAX_CONNECTIONS - 1)
    slow: list[SlowClient] = []
    try:
        # The edge is full: one more connection is closed at accept, and Envoy counts it.
        wait_until(lambda: _connection_is_refused(port), HANG_S, "the connection limit to refuse")
        wait_until(
            lambda: edge.envoy_stat(overflow) > overflow_before,
            HANG_S,
            "Envoy to count the refused connection",
        )
        # The steady client is served while the edge is full (the holders never leave: it is
        # still full after each answer).
        for _ in range(5):
            status, _headers, _data = steady.post_json(CHAT, BODY)
            assert status == 200
            assert _connection_is_refused(port), "the edge was not full"
        # Each receive timer ends its slow request (a 408, or a close for slow headers),
        # counted by Envoy as that timer's, and the place it frees takes a new client.
        for slow_headers, counter in ((False, BODY_TIMEOUTS), (True, HEADER_TIMEOUTS)):
            holders.pop().close()
            _until_a_place_is_free(edge)
            before = edge.envoy_stat(counter)
            client = _fill_with(port, lambda h=slow_headers: SlowClient(port, slow_headers=h))
            slow.append(client)
            assert client.closed.wait(HANG_S), "no receive timer ended the slow request"
            if client.answer:
                assert client.answer.startswith(b"HTTP/1.1 408"), client.answer[:80]
            wait_until(lambda c=counter, b=before: edge.envoy_stat(c) > b, HANG_S, counter)
            assert _served_on_a_new_connection(port), "the freed place took no new client"
            _until_a_place_is_free(edge)
            holders += _hold(port, 1)  # full again for the next timer
        assert steady.post_json(CHAT, BODY)[0] == 200
    finally:
        for client in slow:
            client.stop()
        for sock in holders:
            sock.close()
        steady.close()


def _until_a_place_is_free(edge: FleetStack) -> None:
    """Until Envoy has seen a closed connection go: a client that connects before that is
    closed at accept, and on a starved machine its own thread may notice only after a probe
    found the edge full, so it would pass for the client holding the last place."""
    active = f"listener.127.0.0.1_{edge.listener_port}.downstream_cx_active"
    wait_until(lambda: edge.envoy_stat(active) < MAX_CONNECTIONS, HANG_S, "Envoy to free a place")


def _served_on_a_new_connection(port: int) -> bool:
    """A new client is served (retried while the edge still refuses it, bounded by HANG_S)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        fresh = Client(port, timeout=HANG_S)
        try:
            if fresh.post_json(CHAT, BODY)[0] == 200:
                return True
        except OSError:
            pass  # still full: Envoy closed it at accept
        finally:
            fresh.close()
        time.sleep(0.1)
    return False


def _body_of_size(size: int) -> bytes:
    head = b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def test_the_largest_allowed_body_is_admitted_and_one_byte_more_is_a_json_413(
    edge: FleetStack,
) -> None:
    # The buffer limits admit the configured maximum body: it is placed and budgeted like any
    # request (not failed open by a buffer or the ext_proc message timeout), and the processor,
    # not Envoy, refuses one byte more.
    headers = {"x-session-id": "largest-body"}
    largest = _body_of_size(MAX_BODY_BYTES)
    assert len(largest) == MAX_BODY_BYTES
    primary = placement_for(load_runtime(edge.fleet_path), CHAT, largest, headers).primary
    client = Client(edge.listener_port)
    try:
        before = edge.envoy_stat("cluster.all_clusters.upstream_rq_total")
        status, hdrs, data = client.post_json(CHAT, largest, headers)
        assert (status, hdrs.get("x-served-by")) == (200, primary), data[:200]
        assert edge.envoy_stat("cluster.all_clusters.upstream_rq_total") == before
        status, _hdrs, data = client.post_json(CHAT, _body_of_size(MAX_BODY_BYTES + 1), headers)
        assert status == 413
        assert orjson.loads(data)["error"]["code"] == "request_too_large"
    finally:
        client.close()


def test_http2_clients_get_a_bounded_number_of_streams(edge: FleetStack) -> None:
    # Each stream may buffer a maximum-size body: the connection limit bounds memory only if
    # the streams per connection are bounded too (Envoy's own default is 2^31 - 1).
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((LOOPBACK, edge.listener_port), timeout=10) as sock:
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        settings: dict[int, int] = {}
        while not settings:
            data = sock.recv(65536)
            assert data, "Envoy closed the HTTP/2 connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settings = {k: v.new_value for k, v in event.changed_settings.items()}
    assert settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 100
    # Envoy takes the stream window as the HTTP/2 stream's buffer limit: it is the largest
    # allowed body's buffer, or an HTTP/2 body above the window got Envoy's own 413.
    want = MAX_BODY_BYTES + BUFFER_HEADROOM
    assert settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] == want
