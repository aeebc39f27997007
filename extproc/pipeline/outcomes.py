"""What the pipeline answers for one request, and what a routed exchange holds until it ends.

Six outcomes, each translated to one Envoy answer by the protocol shell
(extproc/protocol/server.py, with extproc/protocol/responses.py building the messages):

- :class:`Passthrough` — not an inference request: Envoy proceeds untouched;
- :class:`~extproc.core.api.BadRequest` — the client's fault: a JSON error in the API's format;
- :class:`Rejected` — admission said no (429 with retry hints, 413 never admissible, 503 ledger
  unavailable under the ``closed`` policy);
- :class:`Unavailable` — a known model with no cluster to go to: 503 with a retry hint;
- :class:`ModelList` — GET /v1/models of a model-aware fleet: the union of its models;
- :class:`Routed` — where the request goes (clusters, or endpoints in endpoint-picker mode);
  its :class:`Hold` is what :meth:`~extproc.pipeline.pipeline.Pipeline.release` gives back.

and, for the protocol shell only, :class:`Waiting`: queued for budget, the answer comes later.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from extproc.core.admission import Reject, Ticket
from extproc.core.affinity import Kind
from extproc.core.api import Api, BadRequest
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.flow import FairCharge
from extproc.core.keys import SessionKey
from extproc.core.models import ModelUnavailable
from extproc.core.pd import PrefillChoice
from extproc.core.usage import SseUsageScanner
from extproc.ledger.tenant_limits import TenantSlot


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Not an inference request (another path, or not a POST)."""


PASSTHROUGH = Passthrough()


@dataclass(slots=True)
class Hold:
    """What one routed exchange holds while Envoy keeps its stream open.

    Mutable on purpose: the response phases fill in what they learn (which cluster served,
    the SSE usage scanner), and release() empties it, so a second release gives nothing back.
    """

    api: Api
    # Envoy's x-request-id, for the debug lines of admission and release (`extproc chaos`
    # joins them with what the upstreams saw).
    request_id: str = ""
    # Budget reservation, held until the exchange ends.
    ticket: Ticket | None = None
    # Load-aware affinity only: the cluster counted in flight for this exchange, and whether
    # its response's load report was read already.
    routed_to: str | None = None
    reported: bool = False
    # Usage inspection only: the cluster credited with the response's tokens (the primary, or
    # the serving cluster the response names) and the scanner when the response is SSE.
    usage_cluster: str | None = None
    # The canonical model whose prices cost the usage ("" : the fleet's prices).
    usage_model: str = ""
    usage_scanner: SseUsageScanner | None = None
    # The cluster that served the response, when Envoy or the engine named one of ours.
    served_by: str | None = None
    # Responses API with links on: the session the response's id is to be linked to, until
    # the id is read (extproc.core.response_links).
    link_session: SessionKey | None = None
    # Disaggregated requests only: the prefill pool's reservation and the prefill endpoint
    # counted in flight (extproc.core.pd).
    prefill_ticket: Ticket | None = None
    prefill_endpoint: str | None = None
    # Endpoint-picker mode: the engine counted in flight for the bounded-load choice (and
    # credited with the response's usage when inspected).
    engine: str | None = None
    # Usage inspection: the engine credited with the response's tokens (the host Envoy says
    # served, else the picker's first choice).
    usage_engine: str | None = None
    # Per-tenant limits: the slot of the tenant's own limits it holds.
    tenant_slot: TenantSlot | None = None
    # Served through a contended queue: where its output is charged to its tenant's counter
    # once usage inspection reads it (extproc.core.flow, tokens fairness).
    fair: FairCharge | None = None
    # Per-tenant metrics on: the tenant's keyed label, credited with what it is served.
    tenant_label: str | None = None

    @property
    def held(self) -> bool:
        """Whether release() has anything to give back."""
        return (
            self.ticket is not None
            or self.routed_to is not None
            or self.prefill_ticket is not None
            or self.prefill_endpoint is not None
            or self.engine is not None
            or self.tenant_slot is not None
        )


# Not frozen: a frozen dataclass's __init__ costs about a microsecond more per request, and
# nothing mutates an outcome after the pipeline returns it.
@dataclass(slots=True)
class Routed:
    facts: RequestFacts
    route: Route
    # How the placement was reached: "primary" without load-aware affinity, else the policy's kind.
    kind: Kind
    hold: Hold
    # Endpoint-picker mode only: the endpoints Envoy should try, in order; empty when no
    # endpoint of any candidate cluster is ready (answered with a 503). None in route mode.
    endpoints: tuple[str, ...] | None = None
    # Disaggregated classes only: the prefill endpoint signalled to the decode-side sidecar
    # (None in the choice: the decode target prefills itself).
    prefill: PrefillChoice | None = None
    # Route mode with sticky engines: x-fleet-engine-key, what Envoy's ring hash reads.
    engine_key: str | None = None
    # The pool data path in a model-aware fleet: the model's own pool (an Envoy cluster of its
    # endpoints) that the endpoints are tried in; None: the pool of every endpoint.
    pool: str | None = None
    # Route mode, a LoRA adapter's request: the engines to try (its loaded one in the primary,
    # then the retry's), routed to the cluster of every endpoint, whose override_host reads
    # them; empty: the pair aggregate and the engine key's hash decide.
    engines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejected:
    facts: RequestFacts
    route: Route
    kind: Kind
    reject: Reject


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A known model with no cluster to place it on: 503 with a retry hint (nothing held)."""

    facts: RequestFacts
    miss: ModelUnavailable


@dataclass(frozen=True, slots=True)
class ModelList:
    """GET /v1/models in a model-aware fleet: the fleet's union, answered by the processor."""

    body: bytes


Outcome = Routed | Rejected | BadRequest | Passthrough | Unavailable | ModelList


@dataclass(slots=True)
class Waiting:
    """Over budget, queued for up to ``max_wait_s`` (extproc/core/flow.py): not an answer yet.

    Only a decision asked not to wait returns it (``Pipeline.decide(..., wait=False)``, as the
    protocol shell's :class:`~extproc.pipeline.exchange.Exchange` asks), so the shell can keep
    Envoy's message timer from firing before it awaits :attr:`resume`, which ends as Routed or
    Rejected. :attr:`cancel` (idempotent) withdraws the request when the stream ends first;
    nothing is held while waiting.
    """

    facts: RequestFacts
    route: Route
    kind: Kind
    max_wait_s: float
    resume: Callable[[], Awaitable[Outcome]]
    cancel: Callable[[], None]
