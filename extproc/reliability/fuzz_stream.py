"""Fuzz the ext_proc stream handler in-process: a real grpc.aio server and channel, no Envoy.

The harness plays Envoy for each :class:`~extproc.reliability.fuzz_cases.Case`: request
headers, the body (whole, split, or followed by trailers), then — for a routed request — the
upstream's response headers and body, one answer awaited per message. It stops sending after
an immediate response, as Envoy does. Each step has a deadline: a step that does not answer is
a hung stream; a gRPC error is a crashed stream.

The processor runs with an in-memory admission gate, load-aware affinity and usage inspection
on, so every phase handler and the budget path see the hostile input. After the run, no budget
may be held and no stream may be open.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client import CollectorRegistry

from extproc.config import Runtime, compile_runtime, parse_config
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.names import BUFFER_HEADROOM
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol.server import FleetProcessor
from extproc.reliability.fuzz_cases import Case, judge_answer
from extproc.serve.service import grpc_options

STEP_TIMEOUT_S = 20.0


def fuzz_config(max_body_bytes: int = 4 << 20) -> dict[str, Any]:
    """Three clusters, size classes plus a tier-only class, every optional reader switched on."""
    return {
        "version": 1,
        "processor": {"max_body_bytes": max_body_bytes, "inspect_usage": True},
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:{8000 + i}"]} for i in (1, 2, 3)],
        "session": {
            "header": "x-session-id",
            "tier_header": "x-tenant-tier",
            "body_fields": [
                "prompt_cache_key",
                "conversation",
                "conversation.id",
                "user",
                "metadata.user_id",
                "metadata.session_id",
            ],
        },
        "classes": [
            {"name": "gold", "tiers": ["gold"], "budget": {"max_concurrent": 64}},
            {
                "name": "short",
                "max_input_tokens": 2048,
                "budget": {"max_inflight_tokens": 262144, "max_concurrent": 128},
            },
            {
                "name": "medium",
                "max_input_tokens": 100000,
                "budget": {"max_inflight_tokens": 1048576, "max_concurrent": 32},
            },
            {"name": "long", "budget": {"max_inflight_tokens": 4194304, "max_concurrent": 8}},
        ],
        "affinity": {"enabled": True},
    }


def _header_map(pairs: Sequence[tuple[str, bytes]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def request_messages(case: Case) -> list[ep.ProcessingRequest]:
    """What Envoy sends for this case's request, in order."""
    pseudo = [
        (":method", case.method.encode()),
        (":path", case.path.encode()),
        (":authority", b"gateway"),
        (":scheme", b"http"),
    ]
    no_body = not case.body and not case.trailers
    out = [
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(
                headers=_header_map(pseudo + list(case.headers)), end_of_stream=no_body
            )
        )
    ]
    if no_body:
        return out
    size = max(1, -(-len(case.body) // case.chunks))
    pieces = [case.body[i : i + size] for i in range(0, len(case.body), size)] or [b""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1 and not case.trailers
        out.append(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=last)))
    if case.trailers:
        out.append(
            ep.ProcessingRequest(
                request_trailers=ep.HttpTrailers(trailers=_header_map(list(case.trailers)))
            )
        )
    return out


def response_messages(case: Case) -> list[ep.ProcessingRequest]:
    return [
        ep.ProcessingRequest(
            response_headers=ep.HttpHeaders(headers=_header_map(list(case.response_headers)))
        ),
        ep.ProcessingRequest(
            response_body=ep.HttpBody(body=case.response_body, end_of_stream=True)
        ),
    ]


@dataclass
class Tally:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    mutations: Counter[str] = field(default_factory=Counter)
    defects: list[tuple[str, Case]] = field(default_factory=list)
    max_defects_kept: int = 20
    # Every defect counted by (what was wrong, whether the request carried trailers): the kept
    # examples are capped, and a known open defect must be told apart from a new one.
    defect_kinds: Counter[tuple[str, bool]] = field(default_factory=Counter)

    def record(self, case: Case, outcome: str, defect: str | None) -> None:
        self.cases += 1
        self.outcomes[outcome] += 1
        self.mutations.update(case.mutations)
        if defect is not None:
            self.outcomes["defect"] += 1
            self.defect_kinds[(defect, bool(case.trailers))] += 1
            if len(self.defects) < self.max_defects_kept:
                self.defects.append((defect, case))


class StreamHarness:
    """One in-process processor over real gRPC; ``play`` runs one case."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.runtime: Runtime = compile_runtime(parse_config(config or fuzz_config(), "fuzz"))
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.gate: AdmissionGate = build_gate(
            self.runtime, self.registry, time.monotonic, random.Random(0)
        )
        self.clusters = tuple(self.runtime.cluster_names)
        self.edge_buffer_bytes = self.runtime.config.processor.max_body_bytes + BUFFER_HEADROOM
        self.classes = tuple(c.name for c in self.runtime.policy.classes)
        self._server: Any = None
        self._channel: Any = None
        self._stub: Any = None

    async def start(self) -> None:
        await self.gate.start()
        max_body = self.runtime.config.processor.max_body_bytes
        self._server = grpc.aio.server(options=grpc_options(max_body))
        self._pipeline = Pipeline(RuntimeHolder(self.runtime), self.metrics, self.gate)
        ep_grpc.add_ExternalProcessorServicer_to_server(
            FleetProcessor(self._pipeline), self._server
        )
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=unlimited)
        self._stub = ep_grpc.ExternalProcessorStub(self._channel)

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        if self._server is not None:
            await self._server.stop(None)
        await self._pipeline.aclose()
        await self.gate.close()

    def sample(self, name: str) -> float:
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name:
                    total += s.value
        return total

    def leftovers(self) -> dict[str, float]:
        """What must be zero once every stream has ended."""
        return {
            "gate_held": float(self.gate.held),
            "budget_inflight_requests": self.sample("fleet_budget_inflight_requests"),
            "budget_inflight_tokens": self.sample("fleet_budget_inflight_tokens"),
            "streams_active": self.sample("fleet_extproc_streams_active"),
            "stream_errors": self.sample("fleet_extproc_stream_errors_total"),
        }

    async def play(self, case: Case) -> tuple[str, str | None]:
        """(outcome, defect or None). Outcomes: routed, error_<status>, passthrough, edge_413."""
        if len(case.body) > self.edge_buffer_bytes:
            # Envoy's buffer limit answers before any of this reaches the processor.
            return "edge_413", None
        call = self._stub.Process()
        try:
            return await self._play(call, case)
        except TimeoutError:
            call.cancel()
            return "hung", "a stream step did not answer within the deadline"
        except grpc.aio.AioRpcError as exc:
            return "crashed", f"stream failed: {exc.code().name} {exc.details()}"

    async def _step(self, call: Any, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await asyncio.wait_for(call.write(msg), STEP_TIMEOUT_S)
        answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT_S)
        if answer is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), "early EOF"
            )
        assert isinstance(answer, ep.ProcessingResponse)
        return answer

    async def _play(self, call: Any, case: Case) -> tuple[str, str | None]:
        routed: dict[str, str] | None = None
        immediate: ep.ImmediateResponse | None = None
        for msg in request_messages(case):
            answer = await self._step(call, msg)
            kind = answer.WhichOneof("response")
            if kind == "immediate_response":
                immediate = answer.immediate_response
                break
            if kind not in ("request_headers", "request_body"):
                continue  # trailers answers carry no routing
            common = getattr(answer, kind).response
            sets = {
                h.header.key: h.header.raw_value.decode("utf-8", "replace")
                for h in common.header_mutation.set_headers
            }
            if "x-fleet-route" in sets:
                routed = sets
        if immediate is None and routed is not None:
            for msg in response_messages(case):
                answer = await self._step(call, msg)
                if answer.WhichOneof("response") == "immediate_response":
                    return "crashed", "immediate response in the response phase"
        await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT_S)
        rest = await asyncio.wait_for(call.read(), STEP_TIMEOUT_S)
        if rest is not grpc.aio.EOF:
            return "crashed", f"unexpected extra answer {rest}"
        await asyncio.wait_for(call.wait_for_connection(), STEP_TIMEOUT_S)
        code = await asyncio.wait_for(call.code(), STEP_TIMEOUT_S)
        if code != grpc.StatusCode.OK:
            return "crashed", f"stream ended with {code.name}"
        if not case.inference:
            if immediate is not None or routed is not None:
                return "decided", "a non-inference request got a decision"
            return "passthrough", None
        status = immediate.status.code if immediate is not None else None
        content_type = None
        if immediate is not None:
            for h in immediate.headers.set_headers:
                if h.header.key == "content-type":
                    content_type = h.header.raw_value.decode("utf-8", "replace")
        defect = judge_answer(
            case,
            status,
            routed,
            immediate.body if immediate is not None else b"",
            content_type,
            self.clusters,
            self.classes,
        )
        outcome = "routed" if routed is not None else f"error_{status}"
        return outcome, defect


async def play_batch(harness: StreamHarness, batch: Sequence[Case], tally: Tally) -> None:
    """Several streams at once, as Envoy multiplexes them over one channel."""
    results = await asyncio.gather(*(harness.play(c) for c in batch))
    for case, (outcome, defect) in zip(batch, results, strict=True):
        tally.record(case, outcome, defect)
