"""The core's rendezvous placement evaluated for a million sessions at once with numpy.

This is the same function as :class:`extproc.core.placement.Rendezvous`, not a look-alike:
the hash is ``mix64(point ^ cluster_seed(name))`` with the constants and seeds imported from
the core, equal weights compare ``float(z)`` exactly as ``Rendezvous.top2`` does, and weights
use ``w / -ln(u)`` with ``u = ((z >> 11) + 0.5) / 2**53``. ``tests/unit/test_sim_vector.py``
checks the result against ``Rendezvous.top2`` and ``Rendezvous.ranked`` key by key.

Ties: the core's ``top2`` keeps the lower index on equal scores; ``np.argsort(kind="stable")``
on the negated scores does the same. Equal float scores need two 64-bit hashes that agree in
their top 53 bits (probability ~2**-53 per pair), so no run here ever meets one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from extproc.core.placement import MIX1, MIX2, cluster_seed

U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]
I32 = npt.NDArray[np.int32]

# Sessions per chunk: chunk x clusters x 8 bytes stays a few tens of MB at 512 clusters.
_CHUNK = 8192
_INV_2_53 = 1.0 / float(1 << 53)


def mix64_np(x: U64) -> U64:
    """``extproc.core.placement.mix64`` on an array (uint64 arithmetic wraps modulo 2**64)."""
    m1 = np.uint64(MIX1)
    m2 = np.uint64(MIX2)
    x = (x ^ (x >> np.uint64(30))) * m1
    x = (x ^ (x >> np.uint64(27))) * m2
    return x ^ (x >> np.uint64(31))


def seeds_of(names: Sequence[str]) -> U64:
    return np.array([cluster_seed(n) for n in names], dtype=np.uint64)


def scores(points: U64, seeds: U64, weights: F64 | None) -> F64:
    """Score matrix (sessions x clusters), the values ``Rendezvous.scores`` returns."""
    z = mix64_np(points[:, None] ^ seeds[None, :])
    if weights is None:
        # float(z) as the core does: uint64 -> float64 rounds to nearest, like int -> float.
        return z.astype(np.float64)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * _INV_2_53
    result: F64 = weights[None, :] / -np.log(u)
    return result


def ranking(
    points: U64,
    names: Sequence[str],
    weights: Sequence[float],
    depth: int,
) -> npt.NDArray[np.int16]:
    """The first ``depth`` clusters of every session's preference order, as cluster indices.

    Column 0 is ``Rendezvous.top2(point).primary``, column 1 its secondary, and the whole row
    is ``Rendezvous.ranked(point)[:depth]`` (barring exact score ties, see the module note).
    """
    n = len(names)
    if n == 0:
        raise ValueError("ranking needs at least one cluster")
    if len(weights) != n:
        raise ValueError("one weight per cluster")
    if n > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} clusters")
    depth = min(depth, n)
    seeds = seeds_of(names)
    # Same rule as Rendezvous: equal weights take the logarithm-free path.
    w = None if len(set(weights)) == 1 else np.asarray(weights, dtype=np.float64)
    out = np.empty((len(points), depth), dtype=np.int16)
    for lo in range(0, len(points), _CHUNK):
        sc = scores(points[lo : lo + _CHUNK], seeds, w)
        if depth < n:
            # Partition first (O(n) per row), then order only the few winners.
            part = np.argpartition(-sc, depth - 1, axis=1)[:, :depth]
            sub = np.take_along_axis(sc, part, axis=1)
            # Among the winners sort by score, then by index (the core keeps the lower index).
            order = np.lexsort((part, -sub), axis=1)
            best = np.take_along_axis(part, order, axis=1)
        else:
            best = np.argsort(-sc, axis=1, kind="stable")
        out[lo : lo + _CHUNK] = best
    return out


def restrict(rank: npt.NDArray[np.int16], members: npt.NDArray[np.bool_], depth: int) -> I32:
    """Each row's first ``depth`` entries that are ``members`` (-1 where a row runs out).

    Rendezvous over a subset of clusters ranks the subset exactly as the full set does (a
    cluster's score does not depend on the others), so an epoch's placement is the full
    ranking with the absent clusters skipped. ``rank`` must be deep enough to hold ``depth``
    members per row; rows that are not are padded with -1.
    """
    is_member = members[rank.astype(np.intp)]
    # Stable sort of "not a member" moves members to the front, keeping their order.
    order = np.argsort(~is_member, axis=1, kind="stable")[:, :depth]
    picked = np.take_along_axis(rank.astype(np.int32), order, axis=1)
    ok = np.take_along_axis(is_member, order, axis=1)
    return np.where(ok, picked, -1).astype(np.int32)


class EpochTables:
    """Every session's top-``depth`` clusters in each membership epoch of a run.

    One ranking over the superset of clusters (base and spares) serves every epoch: it is
    computed ``depth + absent`` deep, where ``absent`` is the most clusters any epoch lacks, so
    each epoch still finds ``depth`` members per row after skipping the absent ones.
    """

    def __init__(
        self,
        points: U64,
        names: Sequence[str],
        weights: Sequence[float],
        memberships: Sequence[npt.NDArray[np.bool_]],
        depth: int,
    ) -> None:
        absent = max(int((~m).sum()) for m in memberships)
        rank = ranking(points, names, weights, depth + absent)
        self.depth = min(depth, len(names))
        self.members = [m.copy() for m in memberships]
        self.tables: list[I32] = [restrict(rank, m, self.depth) for m in memberships]

    def moved(self, before: int, after: int) -> float:
        """Fraction of sessions whose primary differs between two epochs."""
        a, b = self.tables[before][:, 0], self.tables[after][:, 0]
        return float(np.mean(a != b)) if len(a) else 0.0
