"""Per-tenant metrics, opt-in (``flow.tenant_metrics_top``) and bounded: the N tenants with the
most served tokens by their keyed label, the rest as ``tenant="other"``
(extproc.core.top_tenants). Off (0), it records and exports nothing."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from extproc.core.top_tenants import TopTenants


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._top: TopTenants | None = None
        registry.register(self)

    def configure(self, top: int) -> None:
        """Follow the config (a reload may switch it on, off or resize it)."""
        if top <= 0:
            self._top = None
        elif self._top is None or self._top.capacity != top:
            self._top = TopTenants(top)

    @property
    def enabled(self) -> bool:
        return self._top is not None

    def served(self, label: str, tokens: float, requests: int = 0) -> None:
        if self._top is not None:
            self._top.add(label, tokens, requests)

    def describe(self) -> list[Metric]:
        return []  # its names are its own: nothing for the registry to check

    def collect(self) -> Iterator[Metric]:
        top = self._top
        if top is None:
            return
        tokens = CounterMetricFamily(
            "fleet_tenant_served_tokens",
            "Tokens served per tenant (input at admission, output when usage inspection reads "
            "it), for the flow.tenant_metrics_top most served tenants by keyed label; the rest "
            "as tenant=other.",
            labels=["tenant"],
        )
        requests = CounterMetricFamily(
            "fleet_tenant_requests",
            "Requests routed per tenant, labelled as fleet_tenant_served_tokens.",
            labels=["tenant"],
        )
        for label, served, count in top.rows():
            tokens.add_metric([label], served)
            requests.add_metric([label], count)
        yield tokens
        yield requests
