"""The simulated cluster's disaggregated prefill/decode roles, speaking llm-d's and vLLM's P/D
protocol as the real components do.

**Decode** (role ``decode`` or ``both``): the cluster plays llm-d's routing sidecar in front of
its own engine. A request carrying ``x-prefiller-host-port`` (the first of a comma list, as
the sidecar does by default) to ``/v1/chat/completions`` or ``/v1/completions`` runs the
sidecar's NIXL v2 sequence:

1. POST the same path to the prefiller with a fresh ``x-request-id``, the body changed to
   ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id:
   null, remote_block_ids: null, remote_host: null, remote_port: null}``, ``stream: false``,
   no ``stream_options``, and every token limit of the API set to 1 (chat: ``max_tokens`` and
   ``max_completion_tokens``);
2. a failed prefill is handled as the sidecar does since llm-d-inference-scheduler PR #652
   (``shouldFallbackToDecode`` in pkg/sidecar/proxy/proxy_helpers.go): a client error
   (400-451) from the prefiller is passed back with its status, headers and body, and nothing
   is generated; any other failure (a prefiller that cannot be reached, which Go's reverse
   proxy turns into a 502, a 5xx, a connection dropped mid-prefill) falls back to decode-only:
   the original request goes to the local engine, which prefills it itself (colocated; the
   response then has no ``x-prefilled-by``). The client sees a normal answer, so a prefiller
   dying under load fails no request, and no request is generated twice (the fallback is the
   request's only generation; the prefill leg asked for one token and its answer is dropped);
3. otherwise the original request (stream and limits restored) goes to the local engine with
   the prefiller's ``kv_transfer_params``: the engine pulls the KV blocks it lacks from
   ``remote_host:remote_port``, which takes KV bytes / the link bandwidth of the pair's
   topology relation, then decodes. The prefill queue of the decode cluster is not touched.

Without the header (or for ``/v1/messages``, which the sidecar passes straight through) the
engine prefills itself: colocated.

**Prefill** (any role): a request with ``kv_transfer_params.do_remote_decode = true`` is a
vLLM KV producer's request: the prefill is charged on this cluster's prefill queue, and the
answer carries ``kv_transfer_params`` for the decode side (``do_remote_prefill: true``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``). The sim's ``remote_host:remote_port`` is the address the
sidecar dialled (a real vLLM names its NIXL side channel there).

The response names both servers: ``x-served-by`` (decode) and ``x-prefilled-by``; the
simulated timings ``x-sim-prefill-ms`` (the prefiller's own simulated TTFT: queue + compute),
``x-sim-transfer-ms`` and ``x-sim-ttft-ms`` (prefill + transfer + waiting for a decode slot)
expose the plan to benchmarks, in simulated time. The topology comes from the fleet.yaml the
processor reads (``--fleet``): each cluster's role and labels, the levels' bandwidths, KV
bytes per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.config.load import load_config
from extproc.config.runtime import pd_topology
from extproc.core.pd import BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, Topology
from extproc.harness.engine_formats import ORCA_FORMAT_HEADER
from extproc.harness.kvmodel import ModelRequest
from extproc.harness.prompts import ApiKind, PromptError
from extproc.harness.sim_cluster import (
    SIM_TTFT_HEADER,
    SimCluster,
    SimClusterConfig,
    _dumps,
)
from extproc.names import PREFILLER_HEADER

PREFILLED_BY = "x-prefilled-by"
SIM_PREFILL_HEADER = "x-sim-prefill-ms"
SIM_TRANSFER_HEADER = "x-sim-transfer-ms"
SIM_RELATION_HEADER = "x-sim-kv-relation"
KV_TRANSFER_PARAMS = "kv_transfer_params"
# The APIs llm-d's sidecar disaggregates; anything else goes to the local engine untouched.
SIDECAR_APIS: frozenset[ApiKind] = frozenset({"openai-chat", "openai-completions"})
# SGLang: the bootstrap port a null bootstrap_port means (the server's default), how long the
# simulated bootstrap server holds a decode half waiting for its prefill, and how many rooms it
# remembers.
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
BOOTSTRAP_TIMEOUT_S = 30.0
MAX_ROOMS = 4096
# Prefill answers the sidecar passes back to the client instead of falling back to decode-only
# (Go's http.StatusBadRequest .. http.StatusUnavailableForLegalReasons).
CLIENT_ERRORS = (400, 451)
# Headers the sidecar's cloned request must not carry over (hop-by-hop or re-computed).
_DROP = frozenset({"host", "content-length", "transfer-encoding", "connection", PREFILLER_HEADER})

Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class PdSimConfig:
    role: Role
    labels: tuple[str | None, ...]
    # Every endpoint (host:port) of the fleet and its cluster's labels.
    peers: Mapping[str, tuple[str | None, ...]]
    topology: Topology
    kv_bytes_per_token: int = 327_680


def pd_sim_config(fleet: Path, name: str) -> PdSimConfig:
    """This cluster's P/D settings from the fleet.yaml the processor serves."""
    cfg, _ = load_config(fleet)
    topology = pd_topology(cfg)
    mine = next((c for c in cfg.clusters if c.name == name), None)
    if mine is None:
        raise ValueError(f"{fleet}: no cluster named {name!r}")
    peers = {e: topology.labels(c.topology) for c in cfg.clusters for e in c.endpoints}
    return PdSimConfig(
        mine.role,
        topology.labels(mine.topology),
        peers,
        topology,
        cfg.disaggregation.kv_bytes_per_token,
    )


def _first_prefiller(values: list[str]) -> str:
    # The sidecar reads one host per header line or one comma list, and takes the first.
    hosts = values[0].split(",") if len(values) == 1 else values
    return hosts[0].strip() if hosts else ""


def prefill_body(api: ApiKind, body: Mapping[str, Any]) -> dict[str, Any]:
    """The body llm-d's sidecar sends the prefiller (NIXL v2)."""
    out = dict(body)
    out[KV_TRANSFER_PARAMS] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out.pop("stream_options", None)
    limits = ("max_tokens", "max_completion_tokens") if api == "openai-chat" else ("max_tokens",)
    for name in limits:
        out[name] = 1
    return out


class PdSimCluster(SimCluster):
    """A simulated cluster with a P/D role (see the module docstring)."""

    def __init__(
        self,
        config: SimClusterConfig,
        pd: PdSimConfig,
        *,
        clock: Callable[[], float] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if clock is None:
            super().__init__(config, registry=registry)
        else:
            super().__init__(config, clock=clock, registry=registry)
        self.pd = pd
        self._client: aiohttp.ClientSession | None = None
        self._rooms: dict[int, asyncio.Future[tuple[str, float]]] = {}

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/sim/bootstrap/{room}", self._bootstrap)
        return app

    async def close_client(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def _serve(self, request: web.Request, api: ApiKind) -> web.StreamResponse:
        if self._fault.mode != "none" or api not in SIDECAR_APIS:
            return await super()._serve(request, api)
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return await super()._serve(request, api)
        params = body.get(KV_TRANSFER_PARAMS)
        if isinstance(params, dict) and params.get("do_remote_decode") is True:
            return await self._prefill(request, api)
        if BOOTSTRAP_ROOM in body:
            # SGLang's protocol: the same body reaches both servers; the role decides the half.
            rooms = body[BOOTSTRAP_ROOM]
            room = rooms[0] if isinstance(rooms, list) and rooms else rooms
            if not isinstance(room, int) or isinstance(room, bool):
                return self._error(api, 400, "bootstrap_room must be an integer")
            if self.pd.role == "prefill":
                return await self._sglang_prefill(request, api, room)
            hosts, ports = body.get(BOOTSTRAP_HOST), body.get(BOOTSTRAP_PORT)
            host = hosts[0] if isinstance(hosts, list) and hosts else hosts
            port = ports[0] if isinstance(ports, list) and ports else ports
            return await self._sglang_decode(request, api, host, port, room)
        prefiller = _first_prefiller(request.headers.getall(PREFILLER_HEADER, []))
        if prefiller and self.pd.role != "prefill":
            return await self._disaggregated(request, api, body, prefiller)
        return await super()._serve(request, api)

    # -- the prefill side (vLLM KV producer) ------------------------------------------------

    async def _prefill(self, request: web.Request, api: ApiKind) -> web.StreamResponse:
        response = await super()._serve(request, api)
        if response.status != 200 or not isinstance(response, web.Response) or not response.body:
            return response
        assert isinstance(response.body, bytes)
        payload = orjson.loads(response.body)
        usage = payload.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens", 0))
        blocks = -(-prompt_tokens // self.config.params.block_tokens)
        host, _, port = request.host.rpartition(":")
        payload[KV_TRANSFER_PARAMS] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(blocks)),
            "remote_engine_id": f"sim-{self.config.name}",
            "remote_request_id": request.headers.get("x-request-id", ""),
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else None,
            "tp_size": 1,
        }
        response.body = orjson.dumps(payload)
        return response

    # -- the decode side (llm-d routing sidecar + the local engine) --------------------------

    async def _disaggregated(
        self, request: web.Request, api: ApiKind, body: dict[str, Any], prefiller: str
    ) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        headers["x-request-id"] = str(uuid.uuid4())
        if self._client is None:
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        answered: dict[str, str] = {}
        prefilled_by = prefiller
        try:
            async with self._client.post(
                f"http://{prefiller}{request.path}",
                data=orjson.dumps(prefill_body(api, body)),
                headers=headers,
            ) as answer:
                status, data = answer.status, await answer.read()
                answered = dict(answer.headers)
                prefilled_by = answer.headers.get("x-served-by", prefiller)
                # The prefiller's own simulated TTFT (queue + compute): the prefill leg in
                # simulated time, free of this machine's HTTP overhead.
                prefill_ms = float(answer.headers.get(SIM_TTFT_HEADER, "0") or 0)
        except (aiohttp.ClientError, OSError):
            # Go's httputil.ReverseProxy answers a dial/transport error (or a connection
            # dropped mid-prefill) with a 502: not a client error, so decode-only below.
            status, data = 502, b""
        if not 200 <= status < 300:
            if CLIENT_ERRORS[0] <= status <= CLIENT_ERRORS[1]:
                # The request itself was refused (the same request would fail on decode too):
                # the sidecar copies the prefiller's answer, headers included.
                passed = {k: v for k, v in answered.items() if k.lower() not in _DROP}
                passed.update({"x-served-by": self.config.name, PREFILLED_BY: prefilled_by})
                return web.Response(status=status, body=data, headers=passed)
            self.metrics.requests.labels(api=api, code="prefill_fallback").inc()
            return await super()._serve(request, api)
        try:
            params = orjson.loads(data).get(KV_TRANSFER_PARAMS) or {}
            tier = self._relation(params.get("remote_host"), params.get("remote_port"))
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return self._error(api, 400, str(exc))
        return await self._decode_remote(request, api, prefilled_by, prefill_ms, tier)

    async def _decode_remote(
        self, request: web.Request, api: ApiKind, prefilled_by: str, prefill_ms: float, tier: int
    ) -> web.StreamResponse:
        """Decode a request prefilled elsewhere: pull the KV blocks this cluster lacks over
        the pair's link (``tier``: its topology relation), then generate."""
        try:
            parsed = self._parse(api, await request.read())
        except PromptError as exc:
            return self._error(api, 400, str(exc))
        prefill_done = self._clock()
        per_token = self.pd.kv_bytes_per_token / self.pd.topology.bandwidth(tier)
        self.executions[request.headers.get("x-request-id", "")] += 1
        evictions_before = self.model.cache.evictions
        plan = self.model.admit_remote(
            ModelRequest(parsed.hashes, parsed.prompt_tokens, parsed.output_tokens),
            prefill_done,
            per_token,
        )
        self._record(parsed, plan, self.model.cache.evictions - evictions_before)
        scale = self.config.params.time_scale
        decode_ms = (plan.first_token_at - prefill_done) / scale * 1000.0
        extra = {
            PREFILLED_BY: prefilled_by,
            SIM_PREFILL_HEADER: f"{prefill_ms:.3f}",
            SIM_TRANSFER_HEADER: f"{plan.uncached_tokens * per_token * 1000.0:.3f}",
            SIM_RELATION_HEADER: self.pd.topology.relation_name(tier),
            # Prefill leg + transfer + waiting for a decode slot, all in simulated time.
            SIM_TTFT_HEADER: f"{prefill_ms + decode_ms:.3f}",
        }
        request_id = next(self._ids)
        if parsed.stream:
            return await self._stream(request, parsed, plan, request_id, extra)
        await self._sleep_until(plan.done_at)
        self.metrics.requests.labels(api=api, code="200").inc()
        headers_out = self._response_headers(plan, request.headers.get(ORCA_FORMAT_HEADER))
        headers_out.update(extra)
        return web.json_response(
            self._full_body(parsed, plan, request_id), headers=headers_out, dumps=_dumps
        )

    # -- SGLang's bootstrap protocol ---------------------------------------------------------

    def _room(self, room: int) -> asyncio.Future[tuple[str, float]]:
        """The rendezvous of one bootstrap room: set by the prefill half when its prefill is
        done (this prefiller's name, its simulated TTFT), awaited by the decode half."""
        found = self._rooms.get(room)
        if found is None:
            while len(self._rooms) >= MAX_ROOMS:
                # Rooms whose other half never came: the oldest go first.
                self._rooms.pop(next(iter(self._rooms))).cancel()
            found = self._rooms[room] = asyncio.get_running_loop().create_future()
        return found

    async def _sglang_prefill(
        self, request: web.Request, api: ApiKind, room: int
    ) -> web.StreamResponse:
        """An SGLang prefill server's half: prefill (charged on this cluster's prefill queue),
        then the KV is ready for the decode server that joins the room. The answer (one
        token) goes to whoever sent the request; SGLang's router and Envoy's mirror drop it."""
        try:
            parsed = self._parse(api, await request.read())
        except PromptError as exc:
            return self._error(api, 400, str(exc))
        self.executions[request.headers.get("x-request-id", "")] += 1
        plan = self.model.admit(ModelRequest(parsed.hashes, parsed.prompt_tokens, 1), self._clock())
        self._record(dataclasses.replace(parsed, output_tokens=1), plan, 0)
        await self._sleep_until(plan.first_token_at)
        prefill_ms = plan.sim_ttft_s * 1000.0
        waiting = self._room(room)
        if not waiting.done():
            waiting.set_result((self.config.name, prefill_ms))
        one = dataclasses.replace(parsed, output_tokens=1, stream=False)
        self.metrics.requests.labels(api=api, code="200").inc()
        return web.json_response(
            self._full_body(one, plan, next(self._ids)),
            headers=self._response_headers(plan),
            dumps=_dumps,
        )

    async def _bootstrap(self, request: web.Request) -> web.Response:
        """The prefill side's bootstrap server (simulated): wait until the room's prefill is
        done (bounded), then tell the decode side who prefilled it and how long it took. Real
        SGLang moves the KV over Mooncake/NIXL after this handshake; the sim charges the
        transfer on the decode side from the pair's topology."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return web.json_response({"error": "room must be an integer"}, status=400)
        waiting = self._room(room)
        try:
            name, prefill_ms = await asyncio.wait_for(asyncio.shield(waiting), BOOTSTRAP_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            return web.json_response({"error": f"room {room}: no prefill"}, status=504)
        self._rooms.pop(room, None)
        return web.json_response({"prefilled_by": name, "prefill_ms": prefill_ms})

    async def _sglang_decode(
        self, request: web.Request, api: ApiKind, host: object, port: object, room: int
    ) -> web.StreamResponse:
        """An SGLang decode server's half: join the room at the prefill server's bootstrap
        server, receive the KV, decode. A prefill that never comes fails the request before
        any generation (SGLang aborts it with an error; status 500 here, not verified)."""
        port = SGLANG_DEFAULT_BOOTSTRAP_PORT if port is None else port
        if self._client is None:
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        try:
            async with self._client.get(f"http://{host}:{port}/sim/bootstrap/{room}") as answer:
                status, joined = answer.status, await answer.json() if answer.ok else {}
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            status, joined = 502, {"error": str(exc)}
        if status != 200:
            self.metrics.requests.labels(api=api, code="bootstrap_failed").inc()
            return self._error(api, 500, f"KV transfer from {host}:{port} failed (room {room})")
        tier = self._relation(host, port)
        return await self._decode_remote(
            request, api, str(joined["prefilled_by"]), float(joined["prefill_ms"]), tier
        )

    def _relation(self, host: object, port: object) -> int:
        labels = self.pd.peers.get(f"{host}:{port}")
        if labels is None:
            return len(self.pd.topology.levels)  # an unknown peer: the slowest link
        return self.pd.topology.relation(self.pd.labels, labels)
