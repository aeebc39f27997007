"""Budget and ledger metrics over an injected registry (no process globals).

The in-flight gauges count what *this replica* holds, so they return to zero when its traffic
ends and sum correctly over replicas (``sum by (cluster, request_class)``); the Redis ledger
holds the fleet-wide figure.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Decision and ledger latencies: 50 µs to 1 s.
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class LedgerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        compartment = ["cluster", "request_class"]
        self.inflight_tokens = Gauge(
            "fleet_budget_inflight_tokens",
            "Tokens of admitted, unfinished requests held by this replica.",
            compartment,
            registry=registry,
        )
        self.inflight_requests = Gauge(
            "fleet_budget_inflight_requests",
            "Admitted, unfinished requests held by this replica.",
            compartment,
            registry=registry,
        )
        self.limit_tokens = Gauge(
            "fleet_budget_limit_tokens",
            "Configured in-flight token cap per cluster and class (0 = no cap).",
            compartment,
            registry=registry,
        )
        self.limit_requests = Gauge(
            "fleet_budget_limit_requests",
            "Configured concurrent-request cap per cluster and class (0 = no cap).",
            compartment,
            registry=registry,
        )
        self.admissions = Counter(
            "fleet_admissions",
            "Admission decisions by class and result "
            "(admitted, rejected, too_large, unavailable, unbudgeted).",
            ["request_class", "result"],
            registry=registry,
        )
        self.rejections = Counter(
            "fleet_admission_rejections",
            "Requests refused by admission control, by class, HTTP status and reason.",
            ["request_class", "status", "reason"],
            registry=registry,
        )
        self.charges_moved = Counter(
            "fleet_budget_charges_moved",
            "Budget charges moved to the cluster that served a failed-over request, by class"
            " and result: moved (within the serving cluster's budget), over_budget (the serving"
            " cluster's budget was already full: the request runs anyway).",
            ["request_class", "result"],
            registry=registry,
        )
        self.redis_seconds = Histogram(
            "fleet_ledger_redis_seconds",
            "Latency of Redis ledger calls (one round trip each), by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.redis_errors = Counter(
            "fleet_ledger_redis_errors",
            "Redis ledger calls that failed or timed out, by operation.",
            ["op"],
            registry=registry,
        )
        self.mode = Gauge(
            "fleet_ledger_mode",
            "Which ledger admits new requests: 1 for the active mode (redis or local).",
            ["mode"],
            registry=registry,
        )
        self.release_errors = Counter(
            "fleet_ledger_release_errors",
            "Releases that could not be delivered to their ledger (the lease then expires).",
            registry=registry,
        )
        self.leases_lost = Counter(
            "fleet_ledger_leases_lost",
            "Leases the Redis ledger no longer had at renewal (expired or lost with Redis).",
            registry=registry,
        )
        self.reconciled = Counter(
            "fleet_ledger_reconciled",
            "Redis reserves whose caller gave up (timeout, cancellation) and that were then "
            "cancelled, by what Redis had: phantom_removed (the reserve had run) or "
            "not_reserved (refused in advance by a tombstone).",
            ["result"],
            registry=registry,
        )
        self.unsettled = Gauge(
            "fleet_ledger_unsettled",
            "Cancels and releases waiting for Redis to answer (retried every probe interval; "
            "each also lapses with its lease TTL).",
            registry=registry,
        )
        self.adopted = Counter(
            "fleet_ledger_adopted",
            "Reservations admitted on the local share while Redis was unreachable and written "
            "into Redis once it answered again (still running; released there).",
            registry=registry,
        )
        self.leases_held = Gauge(
            "fleet_ledger_leases_held",
            "Reservations this replica holds, by ledger.",
            ["ledger"],
            registry=registry,
        )

        # -- flow control: waiting for budget (extproc/ledger/waiters.py) ---------------------
        self.queue_depth = Gauge(
            "fleet_flow_queue_depth",
            "Requests waiting for budget on this replica, per (cluster, class).",
            compartment,
            registry=registry,
        )
        self.waits = Counter(
            "fleet_flow_waits",
            "Over-budget requests by what flow control did: admitted (after waiting), timeout"
            " (429 after max_wait_s), cancelled (the client left), too_long (429 at once: the"
            " estimated wait exceeds max_wait_s), overflow (429 at once: queue full),"
            " tenant_limit (its tenant's own limits refused it at the head of the queue),"
            " unavailable (503 at the head of the queue: the shared ledger is unreachable"
            " under redis.on_unavailable closed).",
            ["request_class", "result"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "fleet_flow_wait_seconds",
            "Time spent waiting for budget, by class and how the wait ended.",
            ["request_class", "result"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.placements = Counter(
            "fleet_flow_placements",
            "New sessions placed on a later hash candidate because their primary's class"
            " budget was full (flow.place_new_sessions).",
            ["request_class"],
            registry=registry,
        )

    def set_mode(self, mode: str) -> None:
        for m in ("redis", "local"):
            self.mode.labels(m).set(1 if m == mode else 0)
