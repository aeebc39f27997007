"""Engine choice inside a cluster: which endpoint (one engine, one KV cache) serves a session.

A cluster in fleet.yaml lists several endpoints, each an engine with its own KV cache; cluster
affinity without engine affinity re-prefills a session on every engine it is sprayed over. The
processor (endpoint-picker mode, and any mode where it names the host) chooses the engine by
rendezvous hashing of the session point over the cluster's endpoints, the same
highest-random-weight scheme as cluster placement (``core/placement.py``), so the cluster
properties repeat one level down:

- a session keeps its engine while the endpoint set is stable;
- adding or removing one of M engines moves ≈ 1/M of the cluster's sessions (only those whose
  top choice changed);
- an engine that is not ready sends each of its sessions to that session's runner-up: every
  session to ONE other engine (turn after turn), the set of them spread over the others;
- bounded load (consistent hashing with bounded loads, Mirrokni et al.): with a balance factor
  c, no engine takes a request while it holds more than ⌈c · (in flight + 1) / M⌉; a session
  whose engine is full goes to its runner-up, so the spill is itself sticky and stays in the
  cluster (another engine of the same cluster is as cold as one of another cluster, and the
  cluster's budget and failover plan still hold);
- LoRA adapters: a request for an adapter prefers the engines where it is loaded
  (``preferred``, from the endpoints' own model lists): the session's rendezvous order over
  those first, then over the rest, with the same bounded load over all of them, so an
  adapter's sessions share its loaded engines until they are full instead of making every
  engine load it (an engine holds only a few adapters at once: vLLM's ``max_loras``).

The in-flight counts are what the caller saw (one processor replica's own requests): the bound
holds per replica, and with R replicas behind one balancer the fleet-wide excess is at most R·c.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.core.placement import cluster_seed, mix64

# Envoy's hash_balance_factor is a percentage; 1.25 is the bound its docs suggest as a start.
DEFAULT_BALANCE = 1.25
# An engine batches tens to hundreds of sequences (vLLM's max_num_seqs defaults to 256): below a
# few in flight it is not loaded, and moving a session off its cache would only cost a prefill.
DEFAULT_MIN_INFLIGHT = 4


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """Compiled ``engines`` config (fleet.yaml)."""

    sticky: bool = True
    balance: float | None = DEFAULT_BALANCE
    # The bound applies only above this many requests in flight on an engine (engine_cap).
    min_inflight: int = DEFAULT_MIN_INFLIGHT
    # Keys x-fleet-engine-key when the fleet's label secret is configured (file or env); empty
    # with the per-process default secret (see engine_key).
    key_secret: bytes = field(default=b"", repr=False)


def engine_key(digest: bytes, secret: bytes = b"") -> str:
    """The value Envoy's consistent hash (Maglev) reads to keep a session on one engine.

    It must be the same on every processor replica and across restarts, or a session would
    change engine with the replica that handled its turn. The session label
    (``x-fleet-session``) is not: without a configured secret it is keyed per process. So:

    - secret configured (file/env, shared by the replicas): HMAC of the session digest under
      it, like the label: nothing about the raw session id can be learnt from it;
    - no secret: an unkeyed hash of the digest cut to 16 bits. Stable everywhere; it reveals
      16 bits of a hash of the session id to Envoy and the engines (a dictionary of guessed ids
      can be narrowed 65,536-fold, never reversed to one). 65,536 values are plenty for a ring
      hash over tens of engines (each holds thousands of them).
    """
    if secret:
        return hmac.digest(secret, b"engine\x1f" + digest, "sha256")[:8].hex()
    return hashlib.blake2b(digest, digest_size=2, person=b"fleet-engine").hexdigest()


def endpoint_order(point: int, endpoints: Sequence[str]) -> list[str]:
    """This session's preference order over ``endpoints`` (rendezvous: highest score first).

    An endpoint's seed comes from its name (host:port as configured), so reordering the config
    or adding another cluster moves nothing."""
    return sorted(endpoints, key=lambda e: mix64(point ^ cluster_seed(e)), reverse=True)


def engine_cap(total_inflight: int, engines: int, balance: float, floor: int = 1) -> int:
    """The most requests one of ``engines`` may hold when one more arrives: ⌈c·(n+1)/M⌉, and
    never below ``floor``.

    Never below the mean rounded up, so the engines together can always take the request
    (Σ caps ≥ n + 1 > n = Σ loads: some engine has room). The floor keeps a lightly loaded
    cluster sticky: without it, at n < M/c in flight every engine already serving one request
    counts as full, and two sessions that share an engine would push each other off it."""
    return max(floor, 1, math.ceil(balance * (total_inflight + 1) / engines))


def pick_engine(
    point: int,
    endpoints: Sequence[str],
    ready: Collection[str],
    inflight: Mapping[str, int] | None = None,
    balance: float | None = None,
    min_inflight: int = 1,
    preferred: Collection[str] = (),
) -> str | None:
    """The engine of one cluster that serves this session now, None when none is ready.

    Without ``inflight``/``balance`` the choice is the first ready endpoint in the session's
    rendezvous order. With both, the first ready one whose load is under :func:`engine_cap`
    (``min_inflight`` its floor). ``preferred`` endpoints (an adapter's loaded engines) come
    first in that order, each group in rendezvous order.
    """
    order = [e for e in endpoint_order(point, endpoints) if e in ready]
    if not order:
        return None
    if preferred:
        order = [e for e in order if e in preferred] + [e for e in order if e not in preferred]
    if inflight is None or balance is None or len(order) == 1:
        return order[0]
    cap = engine_cap(sum(inflight.get(e, 0) for e in order), len(order), balance, min_inflight)
    for endpoint in order:
        if inflight.get(endpoint, 0) < cap:
            return endpoint
    return order[0]  # unreachable when loads are consistent (see engine_cap); stay sticky


def pick_endpoints(
    point: int,
    ranked_clusters: Sequence[str],
    endpoints: Mapping[str, Sequence[str]],
    ready: Collection[str],
    count: int = 2,
    inflight: Mapping[str, int] | None = None,
    balance: float | None = None,
    min_inflight: int = 1,
    preferred: Collection[str] = (),
) -> list[str]:
    """Up to ``count`` ready endpoints from distinct clusters, in preference order: the
    primary's engine first, then the secondary's (the fallback Envoy tries on retry), each
    chosen by :func:`pick_engine`, so a failover is sticky on the secondary too."""
    picked: list[str] = []
    for cluster in ranked_clusters:
        engine = pick_engine(
            point, endpoints.get(cluster, ()), ready, inflight, balance, min_inflight, preferred
        )
        if engine is not None:
            picked.append(engine)
        if len(picked) == count:
            break
    return picked


def adapter_engines(
    point: int,
    primary: str,
    secondary: str | None,
    endpoints: Mapping[str, Sequence[str]],
    loaded: Collection[str],
    ready: Collection[str],
    inflight: Mapping[str, int] | None = None,
    balance: float | None = None,
    min_inflight: int = 1,
) -> tuple[str, ...]:
    """Route mode: the engines to name for a LoRA adapter's request, the host Envoy tries first
    and the one its retry goes to. Empty when no ready engine of the primary has the adapter
    ``loaded``: the pair aggregate and the cluster's consistent hash then decide, as for every
    other request.

    First the session's :func:`pick_engine` among the primary's ready loaded engines; then the
    secondary's engine (its loaded ones first), the failover a pair aggregate would make, or,
    with no ready engine there (or no secondary), the primary's next one. Two names, because
    Envoy's override_host moves one name on per retry and falls back to its own policy (round
    robin over every engine, whatever it serves) past the list's end."""
    own = endpoints.get(primary, ())
    first = pick_engine(
        point, [e for e in own if e in loaded], ready, inflight, balance, min_inflight
    )
    if first is None:
        return ()
    then = None
    if secondary is not None:
        then = pick_engine(
            point, endpoints.get(secondary, ()), ready, inflight, balance, min_inflight, loaded
        )
    if then is None:
        then = pick_engine(point, [e for e in own if e != first], ready, preferred=loaded)
    return (first,) if then is None else (first, then)
