"""Fuzz a real Envoy + processor + simulated clusters with raw HTTP/1.1 requests.

Raw sockets, because the cases are what an HTTP library refuses to send: duplicate and
oversized headers, header floods, non-UTF-8 header bytes, chunked uploads with trailers.
Each request is sent on its own connection (``connection: close``) and read to EOF, with a
deadline; no answer within it is a hung request.

An inference POST must come back either from an upstream (Envoy marks those with
``x-envoy-upstream-service-time``) or as a JSON error in the API's own format. The client
sends the header block first and reads an early answer before sending the body, as HTTP clients
do: Envoy answers a malformed header block at once and closes, and a body still in flight
would turn that answer into a TCP reset. Afterwards the simulated
clusters report how many requests reached them without a gateway class: that must equal the
number of pass-through requests (non-inference paths and methods) that reached them — any
more is an inference request that bypassed placement and budgets.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import select
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from extproc.harness.launch import LOOPBACK, FleetStack, http_get
from extproc.reliability import probes
from extproc.reliability.fuzz_cases import Case, judge_answer
from extproc.reliability.fuzz_stream import Tally, fuzz_config

READ_TIMEOUT_S = 60.0
EARLY_ANSWER_WAIT_S = 0.2  # generous: the machine running this may be loaded
CHUNK_ANSWER_WAIT_S = 0.002


def _clean(value: bytes) -> bytes:
    # CR/LF would end the header line: that is request smuggling, not a header value, and a
    # different test. Every other byte goes out as generated.
    return value.replace(b"\r", b"").replace(b"\n", b"")


def wire_request(case: Case) -> tuple[bytes, bytes]:
    """(header block, body bytes as framed on the wire)."""
    lines = [f"{case.method} {case.path} HTTP/1.1".encode(), b"host: gateway"]
    for name, value in case.headers:
        lines.append(name.encode() + b": " + _clean(value))
    chunked = bool(case.trailers) or case.chunks > 1
    if chunked:
        lines.append(b"transfer-encoding: chunked")
    else:
        lines.append(b"content-length: " + str(len(case.body)).encode())
    lines.append(b"connection: close")
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    if not chunked:
        return head, case.body
    size = max(1, -(-len(case.body) // max(1, case.chunks)))
    parts = [case.body[i : i + size] for i in range(0, len(case.body), size)]
    out = []
    for part in parts:
        out.append(f"{len(part):x}\r\n".encode() + part + b"\r\n")
    out.append(b"0\r\n")
    for name, value in case.trailers:
        out.append(name.encode() + b": " + _clean(value) + b"\r\n")
    out.append(b"\r\n")
    return head, b"".join(out)


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return b"".join(out)
        if size == 0:
            break
        out.append(rest[:size])
        data = rest[size + 2 :]
    return b"".join(out)


def _send(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(head)
    for i in range(0, max(1, len(body)), 1 << 16):
        ready, _, _ = select.select(
            [sock], [], [], EARLY_ANSWER_WAIT_S if i == 0 else CHUNK_ANSWER_WAIT_S
        )
        if ready:
            return  # an early answer: read it instead of pushing more
        sock.sendall(body[i : i + (1 << 16)])


def exchange(port: int, request: tuple[bytes, bytes]) -> tuple[int, dict[str, str], bytes] | str:
    """(status, headers, body) or the name of what went wrong."""
    chunks: list[bytes] = []
    try:
        with socket.create_connection((LOOPBACK, port), timeout=READ_TIMEOUT_S) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # Envoy may answer (and close) before reading everything: read the answer.
                _send(sock, *request)
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                chunks.append(data)
    except TimeoutError:
        return "hung"
    except ConnectionResetError:
        if not chunks:
            return "reset"
    except OSError as exc:
        return f"transport: {exc}"
    response = b"".join(chunks)
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return "no status line" if not response else f"bad status line {lines[0][:60]!r}"
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return status, headers, body


def judge_http(
    case: Case, result: tuple[int, dict[str, str], bytes] | str, classes: Sequence[str]
) -> tuple[str, str | None]:
    if isinstance(result, str):
        if result == "hung":
            return "hung", "no answer within the deadline"
        # A connection Envoy closed without an answer is a crashed exchange for the client.
        return "crashed", result
    status, headers, body = result
    # Envoy adds x-envoy-upstream-service-time only once the whole request went upstream; an
    # engine that answers at the request headers (a 404 for an unknown path, with the body
    # still streaming behind the headers on the header path) is told by its own x-served-by.
    upstream = "x-envoy-upstream-service-time" in headers or "x-served-by" in headers
    if not case.inference:
        return ("passthrough_upstream" if upstream else f"passthrough_{status}"), None
    if upstream:
        return "routed", None
    defect = judge_answer(case, status, None, body, headers.get("content-type"), (), classes)
    return f"error_{status}", defect


def fuzz_overrides(response_phases: bool = False) -> dict[str, Any]:
    """FleetStack's overrides for the fuzz run: its session, classes (each with a budget, so
    the processor reads inference responses) and body limit."""
    cfg = fuzz_config()
    overrides: dict[str, Any] = {k: cfg[k] for k in ("session", "classes")}
    overrides["processor"] = {**cfg["processor"], "inspect_usage": response_phases}
    overrides["affinity"] = {"enabled": response_phases}
    return overrides


def run_envoy_fuzz(
    total: int, seed: int = 0, batch: int = 8, pool_size: int = 3000, response_phases: bool = False
) -> tuple[Tally, dict[str, float]]:
    """``response_phases`` switches on affinity and usage inspection, which make Envoy send
    response headers (and bodies) to the processor."""
    from extproc.reliability.fuzz_cmd import generate

    cfg = fuzz_config()
    overrides = fuzz_overrides(response_phases)
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-envoy-"))
    stack = FleetStack(
        workdir,
        clusters=3,
        sim_args=("--time-scale", "0.001"),
        fleet_overrides=overrides,
        access_log=False,
        # A process start takes longer on a loaded machine; 20 s was missed at load ~30.
    )
    tally = Tally()
    passthrough_upstream = 0
    classes = [c["name"] for c in cfg["classes"]]
    with stack, concurrent.futures.ThreadPoolExecutor(batch) as pool:
        _reset_concurrency(stack)

        def sink(chunk: list[Case]) -> None:
            nonlocal passthrough_upstream
            raws = [wire_request(c) for c in chunk]
            results = list(pool.map(lambda raw: exchange(stack.listener_port, raw), raws))
            for case, result in zip(chunk, results, strict=True):
                outcome, defect = judge_http(case, result, classes)
                if outcome == "passthrough_upstream":
                    passthrough_upstream += 1
                tally.record(case, outcome, defect)

        generate(total, seed, batch, sink, pool_size)
        leftovers = _settle(stack)
        unclassed = _unclassed_total(stack)
        leftovers["bypassed_requests"] = float(max(0, unclassed - passthrough_upstream))
        leftovers["processor_down"] = 0.0 if stack.procs[0].alive else 1.0
        leftovers["envoy_down"] = 0.0 if stack.envoy and stack.envoy.alive else 1.0
    return tally, leftovers


def _reset_concurrency(stack: FleetStack) -> None:
    import http.client

    for spec in stack.sim_specs.values():
        conn = http.client.HTTPConnection(LOOPBACK, spec.port, timeout=5)
        try:
            conn.request("DELETE", "/admin/concurrency")
            conn.getresponse().read()
        finally:
            conn.close()


def _unclassed_total(stack: FleetStack) -> int:
    total = 0
    for spec in stack.sim_specs.values():
        _status, body = http_get(spec.port, "/admin/concurrency", 5)
        total += int(orjson.loads(body).get("total", {}).get("", 0))
    return total


def _settle(stack: FleetStack) -> dict[str, float]:
    port = stack.metrics_ports[0]

    def quiet() -> bool:
        s = probes.scrape(port)
        return (
            probes.total(s, "fleet_budget_inflight_requests") == 0
            and probes.total(s, "fleet_extproc_streams_active") == 0
        )

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not quiet():
        time.sleep(0.5)
    s = probes.scrape(port)
    return {
        "budget_inflight_requests": probes.total(s, "fleet_budget_inflight_requests"),
        "budget_inflight_tokens": probes.total(s, "fleet_budget_inflight_tokens"),
        "streams_active": probes.total(s, "fleet_extproc_streams_active"),
        "stream_errors": probes.total(s, "fleet_extproc_stream_errors_total"),
    }
