"""GPU health from a DCGM exporter through a real Envoy and ``extproc serve``.

No DCGM exporter runs here (no GPU): the test serves a page in the exporter's format
(``tests/fixtures/dcgm``) over HTTP on 127.0.0.1, and fleet.yaml points each cluster's engine at
it, c1's engine on GPU 1 and c2's on GPU 0. While GPU 1 is hot, the processor's GPU scraper
marks c1 (``fleet_gpu_hot``): a new session whose hash primary is c1 starts on c2, a session c1
already holds stays there, and ``explain`` names the reason. When GPU 1 cools down, new sessions
go back to their hash primary.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from extproc.config import load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import LOOPBACK, FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.test_load_aware import CHAT, body, metric, sessions_on

HOT_PAGE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "two-gpus-one-hot.txt"
).read_text()
DEVICES = {"c1": "1", "c2": "0"}


def cooled(page: str) -> str:
    """The page with GPU 1's every field at GPU 0's value (both healthy)."""
    of_gpu0: dict[str, str] = {}
    for line in page.splitlines():
        if 'gpu="0"' in line:
            of_gpu0[line.split("{", 1)[0]] = line.rsplit(" ", 1)[1]
    out = []
    for line in page.splitlines():
        if 'gpu="1"' in line:
            line = line.rsplit(" ", 1)[0] + " " + of_gpu0[line.split("{", 1)[0]]
        out.append(line)
    return "\n".join(out) + "\n"


class Exporter:
    """A DCGM exporter stand-in: serves whatever page it is given, on 127.0.0.1."""

    def __init__(self, page: str) -> None:
        self.page = page
        self.scrapes = 0
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = exporter.page.encode()
                exporter.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class GpuStack(FleetStack):
    exporter: str = ""

    def fleet_config(self) -> dict[str, Any]:
        cfg = super().fleet_config()
        for cluster in cfg["clusters"]:
            endpoint = cluster["endpoints"][0]
            device = DEVICES[cluster["name"]]
            cluster["gpus"] = [
                {"endpoint": endpoint, "exporter": self.exporter, "devices": [device]}
            ]
        return cfg


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    running = Exporter(cooled(HOT_PAGE))
    yield running
    running.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, exporter: Exporter) -> Iterator[GpuStack]:
    gpu_stack = GpuStack(
        tmp_path_factory.mktemp("gpu"),
        clusters=2,
        exporter=exporter.address,
        fleet_overrides={
            # No share bound: only the GPU verdict moves sessions here.
            "affinity": {"enabled": True, "balance_factor": 0},
            "gpu_health": {"enabled": True, "interval_ms": 100, "max_age_ms": 5000},
        },
    )
    with gpu_stack:
        yield gpu_stack


def _served(client_port: int, make_client: MakeClient, sid: str) -> str:
    status, hdrs, data = make_client(client_port).post_json(
        CHAT, body(sid, 0), {"x-session-id": sid}
    )
    assert status == 200, data[:300]
    return hdrs["x-served-by"]


def _hot(stack: FleetStack, reason: str) -> bool:
    return metric(stack, "fleet_gpu_hot", cluster="c1", reason=reason) == 1.0


def test_a_hot_gpu_takes_no_new_sessions_and_keeps_its_own(
    stack: GpuStack, exporter: Exporter, make_client: MakeClient
) -> None:
    runtime = load_runtime(stack.fleet_path)
    held, new, later = (sessions_on(runtime, "c1", 1, tag)[0] for tag in ("held", "new", "later"))
    wait_until(lambda: exporter.scrapes > 0, 30, "the processor to scrape the exporter")
    assert _served(stack.listener_port, make_client, held) == "c1"  # cool: its hash primary

    exporter.page = HOT_PAGE
    wait_until(lambda: _hot(stack, "gpu_memory"), 30, "c1 marked hot", interval=0.1)
    admin = f"http://{LOOPBACK}:{stack.metrics_ports[0]}"
    explained = explain_remote(admin, CHAT, {"x-session-id": new}, body(new, 0))
    assert explained["hot"] == {"c1": "gpu_memory"}, explained
    assert (explained["kind"], explained["primary"]) == ("spilled", "c2"), explained
    assert _served(stack.listener_port, make_client, new) == "c2", dump_logs(stack)
    assert _served(stack.listener_port, make_client, held) == "c1"  # its cache is there

    exporter.page = cooled(HOT_PAGE)
    wait_until(lambda: not _hot(stack, "gpu_memory"), 30, "c1 no longer hot", interval=0.1)
    assert _served(stack.listener_port, make_client, later) == "c1"
    # The spilled session stays where its cache now is (its override), as after a KV spill.
    assert _served(stack.listener_port, make_client, new) == "c2"
