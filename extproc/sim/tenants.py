"""Tenants in the simulator, named and ordered as the processor names and orders them.

A request's tenant is what the edge puts in the trusted tenant header (``flow.tenant_header``);
the processor's own :func:`extproc.core.tenants.resolve_tenant` turns it into the tenant's key
(its identity in the fair queue's counters, never the raw name), and the processor's
:meth:`extproc.core.flow.FlowParams.claim` gives the waiter's weight and cost under the
configured ``Fairness``. The simulator's (cluster, class) queues are the processor's
:class:`extproc.core.flow.FairQueue` (extproc/sim/admission.py).
"""

from __future__ import annotations

from extproc.core.flow import FairClaim, FlowParams
from extproc.core.tenants import resolve_tenant
from extproc.sim.traffic import Traffic

# Only the tenants' labels (for logs and metrics) are keyed with the secret; their keys are not.
LABEL_SECRET = b"fleet-simulator"


def tenant_key(flow: FlowParams, name: str) -> str:
    """The queue's key for a request whose tenant header says ``name`` ("" : no header)."""
    header = flow.tenant_header
    headers = {header: name} if header and name else {}
    return resolve_tenant(headers, None, header, flow.tenant_fallback, LABEL_SECRET).key


def claims_for(traffic: Traffic, flow: FlowParams | None) -> list[FairClaim] | None:
    """Per template of ``traffic``: its waiter's claim on the fair order (tenant key, weight,
    cost of its input tokens). None when the traffic names no tenants or no order is given."""
    if flow is None or traffic.t_tenant is None:
        return None
    keys = {name: tenant_key(flow, name) for name in set(traffic.t_tenant)}
    return [
        flow.claim(keys[name], None, tokens)
        for name, tokens in zip(traffic.t_tenant, traffic.t_input, strict=True)
    ]
