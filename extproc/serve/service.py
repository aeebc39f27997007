"""Process wiring for `extproc serve`: gRPC server, health, admin HTTP, reload, shutdown.

Lifecycle:
- start: load and compile fleet.yaml (exit 2 with path-indexed errors if invalid), build the
  admission gate (Redis or in-memory), start gRPC (+ grpc.health.v1) and the admin HTTP server,
  print ``READY grpc=<port> metrics=<port>`` on stdout;
- SIGHUP or a change of the file's contents: reload — validate first; an invalid file is
  rejected with its errors logged and the old runtime keeps serving; a valid one replaces the
  runtime in one reference assignment (placement of existing sessions moves only as consistent
  hashing moves it: ≈1/N on adding or removing one of N clusters);
- SIGTERM/SIGINT: drain (extproc.serve.drain): report NOT_SERVING, keep taking new streams
  until Envoy has moved them to other replicas, then serve the streams of requests in flight
  until they end (their budgets are released then), at most the configured limit, which
  defaults to the longest request the config allows; close the gate, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, Runtime, load_runtime
from extproc.config.drain import drain_times
from extproc.config.label_secret import LabelSecret, warn_if_per_process
from extproc.config.load import runtime_from_bytes
from extproc.config.runtime import Discovered, Overrides, with_discovered_models, with_sketch
from extproc.config.schema import TracingConfig
from extproc.core.admission import request_tokens
from extproc.core.chains import ChainSketch
from extproc.ledger.census import ReplicaCensus
from extproc.ledger.gate import AdmissionGate, build_gate, workers_problem
from extproc.ledger.redis_client import any_client
from extproc.ledger.redis_health import RedisHealth
from extproc.names import BUFFER_HEADROOM
from extproc.pipeline.chain_sync import ChainSync
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.pipeline.engine_scraper import EngineScraper, ScrapeMetrics, plan_of
from extproc.pipeline.explain import explain_outcome, hot_candidates, request_headers
from extproc.pipeline.fleet_state import FleetState, RedisSessions
from extproc.pipeline.gpu_scraper import GpuMetrics, GpuScraper, gpu_plan_of
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.model_discovery import ModelDiscovery
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol.server import ENVOY_RESET_LINGER_S, FleetProcessor
from extproc.protocol.xds import ClusterDiscovery, EndpointDiscovery
from extproc.render.envoy_dynamic import (
    pool_endpoints,
    union_endpoints,
    write_cds,
    write_cds_union,
)
from extproc.render.envoy_xds import dynamic_clusters, union_clusters
from extproc.serve.admin import AdminApp, start_admin
from extproc.serve.drain import drain
from extproc.serve.logs import setup_logging
from extproc.serve.loop_monitor import LoopMonitor

if TYPE_CHECKING:
    from extproc.tracing.otel import DecisionTracer

log = logging.getLogger("extproc.serve")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    config_path: str
    address: str | None = None
    port: int | None = None
    metrics_port: int | None = None
    log_level: str = "info"
    uvloop: bool = True
    # Overrides of processor.drain_timeout_s / drain_delay_s (None: the config's).
    grace_s: float | None = None
    drain_delay_s: float | None = None
    watch_interval_s: float = 1.0
    # Multi-process serving: this process is worker `worker_index` of `workers`, sharing the
    # gRPC port through SO_REUSEPORT on purpose.
    workers: int = 1
    worker_index: int = 0
    # Settings the command line / environment override (--redis-url, $FLEET_REDIS_URL),
    # resolved once by `extproc serve` and compiled into every runtime, reloads included.
    overrides: Overrides = field(default_factory=Overrides)
    envoy_cds_path: str | None = None
    # How long Envoy gets to apply a CDS file (watch, DNS, first health check) before the
    # processor relies on it.
    cds_settle_s: float = 2.0
    # Serve Envoy its clusters over gRPC CDS on the processor's port (extproc/protocol/xds.py;
    # the bootstrap from `extproc envoy --xds`), instead of or beside the CDS file.
    xds_cds: bool = False
    seed: int | None = None


def grpc_options(max_body_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    # The body arrives as one gRPC message: the default 4 MiB receive cap would fail long
    # contexts with a 500. grpcio turns SO_REUSEPORT on by default, which lets a stale processor
    # on the same port silently share traffic: off unless multi-process serving asks for it.
    # Envoy buffers up to max_body_bytes + BUFFER_HEADROOM; the gRPC message carrying that
    # body is a little larger still (protobuf framing, headers), so give gRPC more room than
    # Envoy: a body at Envoy's limit must reach the processor and get a JSON 413.
    limit = max_body_bytes + BUFFER_HEADROOM + (64 << 10)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


class Service:
    def __init__(self, opts: ServeOptions, runtime: Runtime, raw_config: bytes) -> None:
        self.opts = opts
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.loop_monitor = LoopMonitor(self.registry)
        # The chain key's learnt common chains: one per process, kept across reloads.
        self.chains = ChainSketch(runtime.key_rules.chain)
        # Models the endpoints list (model_routing.discovery), added to every runtime's own.
        self.discovered: Discovered = {}
        self.discovered_engines: Discovered = {}  # the same lists per endpoint
        self._base = runtime
        self.holder = RuntimeHolder(self._local_view(runtime))
        self._config_bytes = raw_config
        rng = random.Random(opts.seed)
        # One clock for everything that compares times: the gate, the pipeline's `now` and the
        # Redis health tracker they share.
        self.clock = time.monotonic
        self.redis_health = RedisHealth()
        self.gate: AdmissionGate = build_gate(
            self.holder.current, self.registry, self.clock, rng, health=self.redis_health
        )
        self.health = health.aio.HealthServicer()
        self.endpoint_health: EndpointHealth | None = None
        if _probes_endpoints(runtime):
            self.endpoint_health = EndpointHealth(runtime.endpoints, _health_paths(runtime))
        self.pipeline = Pipeline(
            self.holder,
            self.metrics,
            self.gate,
            endpoint_health=self.endpoint_health,
            fleet=self._fleet_state(runtime),
        )
        self.xds: ClusterDiscovery | None = None
        self.eds: EndpointDiscovery | None = None
        if opts.xds_cds:
            self.xds = ClusterDiscovery(self.registry)
            self.eds = EndpointDiscovery(self.registry)
            self.eds.publish(runtime.version, pool_endpoints(runtime))
            self.xds.publish(runtime.version, dynamic_clusters(runtime))
        # Replicas announce themselves in Redis: a wrong redis.replicas is reported.
        self.census: ReplicaCensus | None = None
        self.draining = False
        self.grpc_port = 0
        self.metrics_port = 0
        self._stop = asyncio.Event()
        self._reload_requested = asyncio.Event()
        self._set_version(None, runtime.version)

    def _local_view(self, runtime: Runtime) -> Runtime:
        """Every runtime keys sessions through this process's chain sketch. (Budgets are never
        split between workers: several workers need the shared ledger, see workers_problem.)"""
        return with_discovered_models(
            with_sketch(runtime, self.chains), self.discovered, self.discovered_engines
        )

    async def _discover_models(self) -> None:
        """model_routing.discovery: re-read the endpoints' model lists on the interval and
        serve the config's lists plus what they add (the config is the floor)."""
        discovery = ModelDiscovery(self._base.config.model_routing.discovery_timeout_s)
        try:
            while not self._stop.is_set():
                routing = self._base.config.model_routing
                if routing.discovery:
                    found = await discovery.poll(self._base.endpoints)
                    engines = discovery.by_endpoint
                    if found != self.discovered or engines != self.discovered_engines:
                        self.discovered = found
                        self.discovered_engines = engines
                        self.pipeline.use(self._local_view(self._base))
                        self.gate.publish_limits(self.holder.current)
                        log.info(
                            "discovered models changed",
                            extra={
                                "models": [
                                    m.name for m in self.holder.current.policy.models.served()
                                ]
                            },
                        )
                interval = (
                    routing.discovery_interval_s
                    if routing.discovery
                    else self.opts.watch_interval_s
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), interval)
        finally:
            await discovery.close()

    def _fleet_state(self, runtime: Runtime) -> FleetState:
        """Affinity state, with the shared session store when Redis is configured: attached
        now, whether or not affinity is on, so a reload that turns affinity on needs no
        restart (the client connects on first use)."""
        redis = runtime.redis
        shared = (
            RedisSessions.from_url(redis.url, redis.key_prefix, redis.timeout_s)
            if redis.url
            else None
        )
        return FleetState(self.metrics, runtime.max_sessions, shared, self.redis_health)

    def _set_version(self, old: str | None, new: str) -> None:
        if old is not None:
            self.metrics.config_info.remove(old)
        self.metrics.config_info.labels(new).set(1)

    # -- readiness / explain -----------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, object]]:
        mode = self.gate.mode
        redis_configured = self.holder.current.redis.url is not None
        degraded = redis_configured and mode != "redis"
        policy = self.holder.current.redis.on_unavailable
        # Degraded to local budgets is a known, configured state: still ready. With the
        # "closed" policy a replica without Redis can only reject, so it is not ready.
        ready = not self.draining and not (degraded and policy == "closed")
        return ready, {
            "config_version": self.holder.current.version,
            "ledger": mode,
            "degraded": degraded,
            "draining": self.draining,
            # Not a reason to be unready, but an operator must see it (e.g. an eviction policy
            # that can drop budget ledger keys).
            "warnings": [*self.gate.warnings, *(self.census.warnings if self.census else [])],
            # The processors that announce themselves in Redis against redis.replicas
            # (ledger/census.py); live is None until the first announcement answered.
            "replicas": (
                {"configured": self.census.configured, "live": self.census.live}
                if self.census
                else None
            ),
        }

    async def explain(self, path: str, headers: dict[str, str], body: bytes) -> dict[str, object]:
        """The decision this processor would take for the request now, on its live state
        (affinity memory, load, endpoint health), changing nothing; plus the budget usage."""
        now = self.clock()
        outcome = await self.pipeline.preview(request_headers(path, headers), body, now)
        result = explain_outcome(self.holder.current, outcome)
        order = result.get("preference_order")
        if isinstance(order, list):
            hot = hot_candidates(self.pipeline.fleet.load, [str(c) for c in order], now)
            if hot:
                result["hot"] = hot
        if result.get("outcome") == "route":
            runtime = self.holder.current
            cls = runtime.policy.class_named(str(result["class"]))
            assert cls is not None  # the class the same runtime just routed with
            result["ledger"] = self.gate.mode
            result["budget_usage_on_primary"] = await self.gate.usage(
                str(result["primary"]), cls.name, cls.budget
            )
            assert isinstance(outcome, Routed)
            tenant = self.pipeline.tenant_key(request_headers(path, headers), outcome.facts)
            result["flow_on_primary"] = await self.gate.flow_preview(
                str(result["primary"]), cls, request_tokens(outcome.facts), tenant
            )
            result["tenant"] = await self.pipeline.tenant_view(
                request_headers(path, headers), outcome.facts, str(result["primary"]), cls.name
            )
        return result

    # -- reload ------------------------------------------------------------------------------
    def request_reload(self) -> None:
        self._reload_requested.set()

    async def reload(self) -> bool:
        path = Path(self.opts.config_path)
        try:
            raw = _file_bytes(path)
        except OSError as exc:
            self._reject([str(exc)])
            return False
        # Remember what was looked at, valid or not: the watcher then retries only when the
        # file changes again, instead of logging the same errors every second.
        self._config_bytes = raw
        try:
            # Off the event loop: compiling a large fleet takes ~1 s of CPU on a busy machine, and
            # every stream's decision waits on this loop (Envoy fails a request open after its
            # message timeout). A thread still shares the GIL, but the interpreter switches
            # every few milliseconds, so the loop keeps answering while the compile runs.
            fresh = await asyncio.to_thread(runtime_from_bytes, raw, str(path), self.opts.overrides)
        except ConfigError as exc:
            self._reject(exc.problems)
            return False
        problem = workers_problem(fresh, self.opts.workers)
        if problem is not None:
            self._reject([problem])
            return False
        old = self.holder.current.version
        if fresh.version == old:
            return True
        cds = self.opts.envoy_cds_path
        if cds or self.xds is not None:
            # Envoy must know every cluster the processor may name before the processor names
            # it, and keep every cluster an in-flight decision named until it is done: publish
            # the union of old and new first, switch, and only then drop what the new config
            # removed.
            if cds:
                # Rendering every cluster is CPU too: off the loop, as the compile above.
                await asyncio.to_thread(write_cds_union, self.holder.current, fresh, cds)
            if self.xds is not None and self.eds is not None:
                union_version = f"{old}+{fresh.version}"
                self.eds.publish(union_version, union_endpoints(self.holder.current, fresh))
                self.xds.publish(union_version, union_clusters(self.holder.current, fresh))
            await asyncio.sleep(self.opts.cds_settle_s)
        self._base = fresh
        await self._start_probing_if_needed(fresh)
        self.pipeline.use(self._local_view(fresh))
        self.gate.publish_limits(self.holder.current)
        if self.endpoint_health is not None:
            self.endpoint_health.update(fresh.endpoints, _health_paths(fresh))
        await self._stop_probing_if_unneeded(fresh)
        self._set_version(old, fresh.version)
        self.metrics.config_reloads.labels("applied").inc()
        if cds or self.xds is not None:
            await asyncio.sleep(self.opts.cds_settle_s)
            if cds:
                await asyncio.to_thread(write_cds, fresh, cds)
            if self.xds is not None and self.eds is not None:
                self.eds.publish(fresh.version, pool_endpoints(fresh))
                self.xds.publish(fresh.version, dynamic_clusters(fresh))
        log.info(
            "config reloaded",
            extra={
                "from_version": old,
                "to_version": fresh.version,
                "clusters": list(fresh.cluster_names),
            },
        )
        return True

    async def _start_probing_if_needed(self, fresh: Runtime) -> None:
        """A reload that first needs endpoint readiness (e.g. its first budget, which turns
        processor.probe_clusters on by default) starts the prober, as a restart would. Its
        first round runs before the new runtime serves: a prober with no round yet would
        report every endpoint not ready."""
        if self.endpoint_health is not None or not _probes_endpoints(fresh):
            return
        prober = EndpointHealth(fresh.endpoints, _health_paths(fresh))
        await prober.start()
        self.endpoint_health = prober
        self.pipeline.use_endpoint_health(prober)
        log.info("endpoint probing started by a reload")

    async def _stop_probing_if_unneeded(self, fresh: Runtime) -> None:
        """The other way round: a reload that turns probing off stops steering around
        unready endpoints, as a restart would."""
        prober = self.endpoint_health
        if prober is None or _probes_endpoints(fresh):
            return
        self.pipeline.use_endpoint_health(None)
        self.endpoint_health = None
        await prober.close()
        log.info("endpoint probing stopped by a reload")

    def _reject(self, problems: list[str]) -> None:
        self.metrics.config_reloads.labels("rejected").inc()
        log.error(
            "config reload rejected; still serving the old config",
            extra={
                "path": self.opts.config_path,
                "problems": problems,
                "serving_version": self.holder.current.version,
            },
        )

    async def _watch_redis(self) -> None:
        """Keep readiness honest about the shared ledger without waiting for traffic."""
        while not self._stop.is_set():
            await self.gate.check_redis()
            if self.census is not None and not self.draining:
                self.census.configure(self.holder.current.redis.replicas)
                await self.census.announce(self.clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.opts.watch_interval_s)

    async def _watch(self) -> None:
        """Reload on SIGHUP, and when the file's bytes change (polled: no inotify dependency,
        and it also catches the symlink swap Kubernetes uses for ConfigMap updates)."""
        path = Path(self.opts.config_path)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reload_requested.wait(), self.opts.watch_interval_s)
            signalled = self._reload_requested.is_set()
            self._reload_requested.clear()
            try:
                changed = _file_bytes(path) != self._config_bytes
            except OSError as exc:
                log.warning("cannot read config file", extra={"path": str(path), "error": str(exc)})
                continue
            if signalled or changed:
                await self.reload()

    async def _warm_chains(self) -> ChainSync | None:
        """With Redis: merge the common chains the other replicas learnt before serving, so a
        restarted replica keys conversations as they do from its first request (an empty
        sketch keys a conversation behind a shared opening differently until it has learnt
        the opening again: another placement, a cold prefix cache). Bounded: a Redis that does
        not answer leaves the sketch to the periodic rounds."""
        redis_cfg = self.holder.current.redis
        if not redis_cfg.url:
            return None
        sync = ChainSync(
            any_client(redis_cfg.url, redis_cfg.timeout_s, 2), redis_cfg.key_prefix, self.chains
        )
        started = time.monotonic()
        warmed = await sync.warm()
        log.info(
            "chain sketch warmed from redis" if warmed else "chain sketch not warmed: redis",
            extra={
                "common_chains": self.chains.common_count,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return sync

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.holder.current.config
        reuse = self.opts.workers > 1
        server = grpc.aio.server(options=grpc_options(cfg.processor.max_body_bytes, reuse))
        tracer = build_tracer(cfg.tracing)
        processor = FleetProcessor(
            self.pipeline, self.clock, reset_linger_s=ENVOY_RESET_LINGER_S, tracer=tracer
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if self.xds is not None and self.eds is not None:
            cds_pb2_grpc.add_ClusterDiscoveryServiceServicer_to_server(self.xds, server)
            eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, server)
        address = self.opts.address or cfg.processor.address
        port = cfg.processor.port if self.opts.port is None else self.opts.port
        self.grpc_port = server.add_insecure_port(f"{address}:{port}")
        if not self.grpc_port:
            log.error("cannot bind gRPC port", extra={"address": address, "port": port})
            return 1
        await self.gate.start()
        chain_sync = await self._warm_chains()
        if self.endpoint_health is not None:
            await self.endpoint_health.start()
        metrics_port = (
            cfg.processor.metrics_port if self.opts.metrics_port is None else self.opts.metrics_port
        )
        if metrics_port and self.opts.workers > 1:
            metrics_port += self.opts.worker_index  # one admin port per worker
        admin = AdminApp(self.registry, self.readiness, self.explain)
        # The admin port serves probes (/readyz) and Prometheus: it listens where gRPC does
        # (a pod IP or 0.0.0.0 in Kubernetes, 127.0.0.1 locally).
        runner, self.metrics_port = await start_admin(admin, address, metrics_port)
        await server.start()
        self.loop_monitor.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        watchers = [asyncio.create_task(self._watch())]
        watchers.append(asyncio.create_task(self._discover_models()))
        # Engine load from their /metrics; the plan is re-read every round, so a reload that
        # turns scraping on or changes the endpoints needs no restart.
        scraper = EngineScraper(
            lambda: plan_of(self.holder.current.config),
            self.pipeline.fleet.scraped,
            ScrapeMetrics(self.registry),
            self.clock,
        )
        watchers.append(asyncio.create_task(scraper.run()))
        gpus = GpuScraper(
            lambda: gpu_plan_of(self.holder.current.config),
            self.pipeline.fleet.gpu_checked,
            GpuMetrics(self.registry),
            self.clock,
        )
        watchers.append(asyncio.create_task(gpus.run()))
        redis_cfg = self.holder.current.redis
        if redis_cfg.url:
            self.census = ReplicaCensus(
                any_client(redis_cfg.url, redis_cfg.timeout_s, 2),
                redis_cfg.key_prefix,
                redis_cfg.replicas,
            )
            await self.census.announce(self.clock())
            watchers.append(asyncio.create_task(self._watch_redis()))
        if chain_sync is not None:
            interval = self.holder.current.config.prefix.sync_interval_s
            watchers.append(asyncio.create_task(chain_sync.run(interval, warmed=True)))
        log.info(
            "serving",
            extra={
                "grpc_port": self.grpc_port,
                "metrics_port": self.metrics_port,
                "config_version": self.holder.current.version,
                "ledger": self.gate.mode,
                "worker": self.opts.worker_index,
            },
        )
        # A machine-readable ready line on stdout for supervisors and tests.
        print(f"READY grpc={self.grpc_port} metrics={self.metrics_port}", flush=True)
        await self._stop.wait()
        self.draining = True
        if self.census is not None:
            await self.census.withdraw()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        times = drain_times(self.holder.current.config, self.opts.grace_s, self.opts.drain_delay_s)
        stoppable = server if self.xds is None else _ClosingXds(server, self.xds, self.eds)
        report = await drain(stoppable, lambda: processor.active, times, time.monotonic)
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await self.gate.close()
        if chain_sync is not None:
            await chain_sync.aclose()
        if self.census is not None:
            await self.census.aclose()
        await self.pipeline.aclose()
        if self.endpoint_health is not None:
            await self.endpoint_health.close()
        await self.loop_monitor.stop()
        await runner.cleanup()
        if tracer is not None:
            # Exports what is still queued; the SDK's exporter blocks, so off the loop.
            await asyncio.to_thread(tracer.shutdown)
        log.info(
            "stopped",
            extra={
                "held_after_drain": self.gate.held,
                "drain_s": round(report.seconds, 3),
                "streams_cut": report.cut,
            },
        )
        return 0


class _ClosingXds:
    """The gRPC server for the drain, ending Envoy's CDS streams when new streams are refused:
    a CDS stream never ends by itself, so the server's stop() would wait for it until the
    drain limit (forever without one). Envoy keeps its clusters and reconnects to another
    replica."""

    def __init__(
        self, server: grpc.aio.Server, xds: ClusterDiscovery, eds: EndpointDiscovery | None
    ) -> None:
        self._server = server
        self._xds = xds
        self._eds = eds

    async def stop(self, grace: float | None) -> None:
        self._xds.close()
        if self._eds is not None:
            self._eds.close()
        await self._server.stop(grace)


def _probes_endpoints(runtime: Runtime) -> bool:
    """Endpoint picking and probe_clusters need every endpoint's readiness; so does P/D, whose
    prefill choice skips dead prefillers (the sidecar would fall back to decode-only)."""
    return runtime.endpoint_picker or runtime.probes_clusters or runtime.pd is not None


def _health_paths(runtime: Runtime) -> dict[str, str]:
    return {c.name: c.health_path for c in runtime.clusters}


def _file_bytes(path: Path) -> bytes:
    # A config file is a few KB: reading it on the loop is cheaper than a thread hop.
    return path.read_bytes()


def build_tracer(cfg: TracingConfig) -> DecisionTracer | None:
    """The decision tracer when tracing is on; with it off, OpenTelemetry is never imported.
    Read at start: turning tracing on or off takes a restart."""
    if not cfg.enabled:
        return None
    from extproc.tracing.otel import DecisionTracer

    tracer = DecisionTracer(cfg)
    log.info("tracing", extra={"endpoint": cfg.endpoint, "sampling_ratio": cfg.sampling_ratio})
    return tracer


async def serve(opts: ServeOptions) -> int:
    try:
        raw = _file_bytes(Path(opts.config_path))
        runtime = load_runtime(opts.config_path, opts.overrides)
    except (ConfigError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    problem = workers_problem(runtime, opts.workers)
    if problem is not None:
        print(f"{opts.config_path}: {problem}", file=sys.stderr)
        return 2
    secret = LabelSecret(runtime.key_rules.label_secret, runtime.label_secret_source)
    warn_if_per_process(secret, runtime.config.session.label_secret_env, bool(runtime.redis.url))
    if opts.envoy_cds_path:
        write_cds(runtime, opts.envoy_cds_path)
    return await Service(opts, runtime, raw).run()


def serve_forever(opts: ServeOptions) -> int:
    setup_logging(opts.log_level)
    if opts.uvloop:
        import uvloop

        return uvloop.run(serve(opts))
    return asyncio.run(serve(opts))
