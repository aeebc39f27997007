"""Consistent placement: weighted rendezvous (highest-random-weight) hashing, top two.

Every (session, cluster) pair gets a pseudo-random score; the session's primary is the cluster
with the highest score and its secondary the runner-up. Properties this buys, all tested:

- removing a cluster moves only the sessions it was primary for (≈1/N), and each such
  session's new primary is exactly its old secondary: the failover target already planned;
- adding a cluster takes ≈1/N of the sessions, from every other cluster evenly;
- secondaries are spread uniformly, so a failed cluster's re-prefill work spreads over the fleet;
- no ring, no virtual nodes, no state: max/mean load ≈ 1.01 at tens of clusters.

Weights use the logarithmic method: score = w / -ln(u), u ∈ (0, 1) uniform from the hash; a
cluster then wins with probability w / Σw. With equal weights the score is monotone in the hash
itself, so that path skips the logarithm.

The hash is a splitmix64 finaliser over (session point XOR cluster seed): pure 64-bit integer
arithmetic, so the fleet simulator can evaluate the same function vectorised with numpy.

Cost at hundreds of clusters: a decision is O(N) hashes, and a Python loop pays
~0.3 µs per cluster. Two things keep it flat in the common case, with the same results:

- a bounded cache of recent session points → placement per ``Rendezvous``: sessions come back
  every turn, and a config reload builds new ``Rendezvous`` objects, so a reload drops the
  cache with the old placer (no stale placement can survive a change of clusters or weights);
- a packed miss path: every cluster's seed sits in one 128-bit lane of one big integer, so the
  whole splitmix64 over all N clusters is eleven big-integer operations (XOR, shift, AND with
  a lane mask, multiply: a lane's 64-bit value times a 64-bit constant fits its 128 bits, so no
  carry crosses lanes); the lanes are read back through a memoryview and compared with C-level
  ``max``/``index``, which keeps the loop's tie rule (lower index wins on equal scores);
- from ``VECTOR_MIN_CLUSTERS`` clusters a miss evaluates the same splitmix64 on a numpy
  ``uint64`` array instead (``_Vector``): about ten array operations whatever N, where the packed
  path's big-integer work grows with N. Equal weights take the top two of ``float(z)`` with
  ``argmax`` (which keeps the first of equal maxima, the loop's tie rule); weights keep the
  packed path's cut and score its few candidates with ``weighted_score`` itself, so numpy's
  logarithm never decides a placement.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import neg, truediv
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy.typing as npt

    _U64 = npt.NDArray[Any]

MASK64 = (1 << 64) - 1
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_INV_2_53 = 1.0 / float(1 << 53)
# Lane width of the packed path: a 64-bit value times a 64-bit constant needs 128 bits.
_LANE = 128
_LANE_BYTES = _LANE // 8
# Below this many clusters the plain loop is as fast as the packed path (measured with
# `extproc bench scale --decisions-only`).
PACKED_MIN_CLUSTERS = 12
# From this many clusters a miss is evaluated with numpy (`_Vector`): its array operations cost
# about the same at 16 clusters as at 512, where the packed path grows with N. Weighted fleets
# also score a few candidates in Python, which moves their crossover up (both measured side by
# side with `extproc bench scale --decisions-only`).
VECTOR_MIN_CLUSTERS = 16
VECTOR_MIN_CLUSTERS_WEIGHTED = 64
# Recent session points remembered per placer (one dict entry and one Placement each,
# ~150 bytes: ~10 MB at the default).
DEFAULT_CACHE_SIZE = 1 << 16


def mix64(x: int) -> int:
    """splitmix64 finaliser: a bijection on 64-bit integers with full avalanche."""
    x = (x ^ (x >> 30)) * MIX1 & MASK64
    x = (x ^ (x >> 27)) * MIX2 & MASK64
    return x ^ (x >> 31)


# Memoised: the pool data path seeds the endpoints of both picked clusters on every request
# (core/endpoints.py endpoint_order), 16 blake2b calls at 8 endpoints per cluster, which was
# most of what the pool's decision cost over the pairs'. Bounded: names come from
# the config (clusters, endpoints), never from requests.
@functools.lru_cache(maxsize=1 << 16)
def cluster_seed(name: str) -> int:
    """A cluster's hash seed comes from its name, so reordering the config moves nothing."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def weighted_score(z: int, weight: float) -> float:
    u = ((z >> 11) + 0.5) * _INV_2_53
    return weight / -math.log(u)


@dataclass(frozen=True, slots=True)
class Placement:
    primary: str
    secondary: str | None

    @property
    def route(self) -> str:
        """Name of the Envoy cluster to route to: the (primary, secondary) aggregate."""
        return self.primary if self.secondary is None else f"{self.primary}__{self.secondary}"


@dataclass(frozen=True, slots=True)
class _Level:
    """A cut that keeps only a few lanes as candidates: lane i is one iff its hash z_i >= T_i.

    ``add`` holds 2**64 - T_i in every lane, so bit 64 of (z_i + 2**64 - T_i) is the test (the
    sum fits the 128-bit lane). ``floor``: every lane below its cut scores at most this, so the
    candidates' top two are the fleet's when the second of them scores more. ``cuts``: the
    T_i themselves (weighted fleets; the numpy path compares against them).
    """

    add: int
    floor: float
    cuts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Packed:
    """The seeds in 128-bit lanes of one integer, and the constants the packed mix needs."""

    n: int
    ones: int  # 1 in every lane: point * ones repeats the point in every lane
    seeds: int
    mask64: int
    mask53: int
    levels: tuple[_Level, ...]

    @classmethod
    def of(cls, seeds: Sequence[int], weights: Sequence[float] | None) -> _Packed:
        n = len(seeds)
        ones = sum(1 << (_LANE * i) for i in range(n))
        packed = sum(s << (_LANE * i) for i, s in enumerate(seeds))
        levels = tuple(
            level
            for expected in _EXPECTED_CANDIDATES
            if expected < n
            for level in [_level(expected, n, weights)]
        )
        return cls(n, ones, packed, ones * MASK64, ones * ((1 << 53) - 1), levels)

    def hashes(self, point: int) -> int:
        """mix64(point ^ seed) in every lane: ``mix64`` step by step, masked per lane."""
        m = self.mask64
        x = self.seeds ^ (point * self.ones)
        x ^= (x >> 30) & m
        x = (x * MIX1) & m
        x ^= (x >> 27) & m
        x = (x * MIX2) & m
        x ^= (x >> 31) & m
        return x

    def candidates(self, x: int) -> Iterator[tuple[list[int], float]]:
        """For each level, the lanes at or above their cut (ascending), and the level's floor."""
        size = self.n * _LANE_BYTES
        for level in self.levels:
            # One flag bit per lane at bit 0 of its first byte: bytes.find skips the zeros in C.
            flags = (((x + level.add) >> 64) & self.ones).to_bytes(size, "little")
            lanes: list[int] = []
            at = flags.find(1)
            while at >= 0:
                lanes.append(at // _LANE_BYTES)
                at = flags.find(1, at + 1)
            if len(lanes) >= 2:
                yield lanes, level.floor

    def lanes(self, x: int) -> Sequence[int]:
        """The low 64 bits of each lane (the high half is zero after masking)."""
        if sys.byteorder == "little":
            # The 'Q' cast reads native order, which is the order the lanes were written in.
            return memoryview(x.to_bytes(self.n * _LANE_BYTES, "little")).cast("Q")[::2]
        return [(x >> (_LANE * i)) & MASK64 for i in range(self.n)]  # pragma: no cover

    def scores(self, point: int, weights: Sequence[float] | None) -> list[float]:
        """``Rendezvous.scores``, bit for bit: the same float operations in the same order."""
        x = self.hashes(point)
        if weights is None:
            return list(map(float, self.lanes(x)))
        k = self.lanes((x >> 11) & self.mask53)
        # weight / -log(((z >> 11) + 0.5) * 2**-53), as weighted_score computes it.
        u = map(_INV_2_53.__mul__, map(float.__add__, map(float, k), repeat(0.5)))
        return list(map(truediv, weights, map(neg, map(math.log, u))))


# Candidates a cut keeps on average; a second, looser cut when the first keeps fewer than two
# (e**-6 * 7 ≈ 1.7 % of decisions), then the full comparison.
_EXPECTED_CANDIDATES = (6, 48)
# Room for the float error of exp/log (~1e-16 relative) when a cut is computed in floats.
_CUT_MARGIN = 1 << 16


def _level(expected: int, n: int, weights: Sequence[float] | None) -> _Level:
    if weights is None:
        # Equal weights score float(z): a lane below T scores at most float(T) (rounding is
        # monotone), so two candidates above float(T) are the top two.
        cut = (1 << 64) - ((1 << 64) * expected) // n
        add = sum(((1 << 64) - cut) << (_LANE * i) for i in range(n))
        return _Level(add, float(cut))
    # w / -ln(u) >= S  <=>  u >= exp(-w / S): a per-lane cut on the hash for one score S,
    # chosen so that about ``expected`` lanes pass (P(lane passes) ≈ w / S).
    score = sum(weights) / expected
    cuts = tuple(max(0, int(math.exp(-w / score) * (1 << 64)) - _CUT_MARGIN) for w in weights)
    add = 0
    for i, cut in enumerate(cuts):
        add |= ((1 << 64) - cut) << (_LANE * i)
    # A lane below its cut has u < exp(-w / S), so it scores below S; the factor covers the
    # float error of the candidates' own scores.
    return _Level(add, score * (1 + 1e-9), cuts)


@dataclass(frozen=True, slots=True)
class _Vector:
    """The seeds as a numpy array: one miss is a fixed number of array operations.

    ``pre`` holds ``seed ^ (seed >> 30)``: mix64's first step distributes over XOR
    ((p ^ s) >> 30 == (p >> 30) ^ (s >> 30)), so it costs one XOR with the point's own part.
    The last step, z = y ^ (y >> 31), leaves the top 33 bits of y as they are, so the order of
    the y's top 31 bits is the order of the z's: the arrays stop at y, and Python finishes the
    few lanes that matter. No buffer is kept between calls (numpy drops the GIL inside a loop
    over more than ~500 elements, and a placer may be shared).
    """

    np: Any  # the numpy module, imported when a fleet is large enough to need it
    pre: _U64
    # Weighted fleets only: lane i is a candidate when y_i >= cuts[i], the packed path's first
    # cut T_i with its low 33 bits cleared (z_i >= T_i implies it), and ``floor`` that level's.
    cuts: _U64 | None
    floor: float
    # numpy scalars made once: building one costs about as much as an array operation.
    k: tuple[Any, Any, Any] = field(init=False)

    def __post_init__(self) -> None:
        u = self.np.uint64
        object.__setattr__(self, "k", (u(MIX1), u(27), u(MIX2)))

    @classmethod
    def of(cls, seeds: Sequence[int], level: _Level | None) -> _Vector:
        import numpy as np

        s = np.array(seeds, dtype=np.uint64)
        pre = s ^ (s >> np.uint64(30))
        if level is None:
            return cls(np, pre, None, 0.0)
        cuts = np.array([c >> _LOW << _LOW for c in level.cuts], dtype=np.uint64)
        return cls(np, pre, cuts, level.floor)

    def premixed(self, point: int) -> _U64:
        """y for every lane: mix64(point ^ seed) == y ^ (y >> 31)."""
        np = self.np
        mix1, s27, mix2 = self.k
        x: _U64 = np.bitwise_xor(self.pre, np.uint64(point ^ (point >> 30)))
        np.multiply(x, mix1, out=x)
        t = np.right_shift(x, s27)
        np.bitwise_xor(x, t, out=x)
        np.multiply(x, mix2, out=x)
        return x

    def top2_equal(self, point: int) -> tuple[int, int] | None:
        """Equal weights: (primary, secondary) lanes by float(z), or None if not proven.

        ``argmax`` on y finds the lanes with the largest top 31 bits. When the best, the second
        and the rest's best differ there, they are the top two of z; the float comparisons prove
        that float(z) keeps them apart too (every other lane's z is below (hc + 1) << 33), so the
        loop's tie rule is never needed. Otherwise (p ~ 1e-6) the caller computes it exactly.
        """
        y = self.premixed(point)
        bi = int(y.argmax())
        yb: int = y.item(bi)  # .item: a Python int at once, no numpy scalar in between
        y[bi] = 0
        si = int(y.argmax())
        ys: int = y.item(si)
        y[si] = 0
        hc = y.item(int(y.argmax())) >> _LOW
        hb, hs = yb >> _LOW, ys >> _LOW
        zb, zs = float(yb ^ (yb >> 31)), float(ys ^ (ys >> 31))
        if hb > hs > hc and zb > zs > float((hc + 1) << _LOW):
            return bi, si
        return None

    def candidates(self, point: int) -> list[int] | None:
        """Weighted fleets: the lanes that may pass the packed path's first cut (ascending)."""
        assert self.cuts is not None
        lanes: list[int] = self.np.flatnonzero(self.premixed(point) >= self.cuts).tolist()
        return lanes if len(lanes) >= 2 else None


class RecentCounts:
    """Decayed counts of recent placements for one candidate list, as numpy arrays: the value
    each lane was last brought to and when (extproc.pipeline.fleet_state keeps them beside its
    own dict, the same floats), so the lanes within a limit are found in one pass."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.np = np
        self.value = np.zeros(n)
        self.at = np.zeros(n)

    def set(self, lane: int, value: float, at: float) -> None:
        self.value[lane] = value
        self.at[lane] = at

    def lanes(self, now: float, half_life_s: float, low: float, high: float) -> tuple[Any, Any]:
        """(count + 1 < low, count + 1 <= high) per lane at ``now`` (no lane placed after it)."""
        np = self.np
        plus = self.value * np.exp2((self.at - now) / half_life_s) + 1.0
        return plus < low, plus <= high


# Below this many clusters sorting every score costs less than the partition (measured).
HEAD_MIN_CLUSTERS = 48

# mix64's last step keeps the top 64 - _LOW bits of its input.
_LOW = 33


def _top2_of(scores: list[float]) -> tuple[int, int]:
    """Indices of the best and second-best score; the lower index wins a tie (as the loop)."""
    best = max(scores)
    bi = scores.index(best)
    if len(scores) == 1:
        return bi, -1
    scores[bi] = -1.0  # every score is >= 0
    return bi, scores.index(max(scores))


@dataclass(frozen=True, slots=True)
class Rendezvous:
    names: tuple[str, ...]
    weights: tuple[float, ...]
    cache_size: int = DEFAULT_CACHE_SIZE
    # False: the plain loop at every size (the benchmark's baseline; same answers).
    vectorise: bool = True
    # False: the packed path even from VECTOR_MIN_CLUSTERS (the benchmark's comparison; same
    # answers).
    numpy: bool = True
    seeds: tuple[int, ...] = field(init=False)
    equal: bool = field(init=False)
    _packed: _Packed | None = field(init=False, repr=False, compare=False, hash=False)
    _vector: _Vector | None = field(init=False, repr=False, compare=False, hash=False)
    _cache: dict[int, Placement] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("rendezvous needs at least one cluster")
        if len(self.names) != len(self.weights):
            raise ValueError("one weight per cluster")
        if len(set(self.names)) != len(self.names):
            # A repeated name could be both primary and secondary of a session.
            raise ValueError(f"duplicate cluster names in {self.names}")
        if not all(w > 0 for w in self.weights):
            raise ValueError(f"weights must be > 0, got {self.weights}")
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {self.cache_size}")
        object.__setattr__(self, "seeds", tuple(cluster_seed(n) for n in self.names))
        object.__setattr__(self, "equal", len(set(self.weights)) == 1)
        wide = self.vectorise and len(self.names) >= PACKED_MIN_CLUSTERS
        weights = None if len(set(self.weights)) == 1 else self.weights
        packed = _Packed.of(self.seeds, weights) if wide else None
        object.__setattr__(self, "_packed", packed)
        vector = None
        if packed is not None and self.numpy:
            n = len(self.names)
            if weights is None and n >= VECTOR_MIN_CLUSTERS:
                vector = _Vector.of(self.seeds, None)
            elif weights is not None and n >= VECTOR_MIN_CLUSTERS_WEIGHTED and packed.levels:
                vector = _Vector.of(self.seeds, packed.levels[0])
        object.__setattr__(self, "_vector", vector)
        object.__setattr__(self, "_cache", {})

    @classmethod
    def of(cls, clusters: Sequence[tuple[str, float]]) -> Rendezvous:
        return cls(tuple(n for n, _ in clusters), tuple(w for _, w in clusters))

    def scores(self, point: int) -> list[float]:
        if self._packed is not None:
            return self._packed.scores(point, None if self.equal else self.weights)
        if self.equal:
            return [float(mix64(point ^ s)) for s in self.seeds]
        return [
            weighted_score(mix64(point ^ s), w)
            for s, w in zip(self.seeds, self.weights, strict=True)
        ]

    @property
    def cached(self) -> int:
        """How many session points the cache holds now."""
        return len(self._cache)

    def top2(self, point: int) -> Placement:
        """The session's (primary, secondary): from the cache of recent points, else computed."""
        cache = self._cache
        hit = cache.get(point)
        if hit is not None:
            return hit
        placed = self.top2_uncached(point)
        if self.cache_size:
            if len(cache) >= self.cache_size:
                # Oldest first (insertion order): a session that keeps coming back is re-added
                # after its eviction at the cost of one miss.
                del cache[next(iter(cache))]
            cache[point] = placed
        return placed

    def top2_uncached(self, point: int) -> Placement:
        vector = self._vector
        if vector is not None:
            if vector.cuts is None:
                top = vector.top2_equal(point)
                if top is not None:
                    return Placement(self.names[top[0]], self.names[top[1]])
            elif (lanes := vector.candidates(point)) is not None:
                bi, si, second = self._top2_among(point, lanes)
                if second > vector.floor:
                    return Placement(self.names[bi], self.names[si])
        packed = self._packed
        if packed is not None:
            # Score only the few lanes above a cut, in index order with the loop's rule; fall
            # back to every score when the cut cannot prove the answer (rare).
            for lanes, floor in packed.candidates(packed.hashes(point)):
                bi, si, second = self._top2_among(point, lanes)
                if second > floor:
                    return Placement(self.names[bi], self.names[si])
            bi, si = _top2_of(self.scores(point))
            return Placement(self.names[bi], self.names[si] if si >= 0 else None)
        best = second = -1.0
        bi = si = -1
        if self.equal:
            for i, s in enumerate(self.seeds):
                sc = float(mix64(point ^ s))
                if sc > best:
                    second, si, best, bi = best, bi, sc, i
                elif sc > second:
                    second, si = sc, i
        else:
            for i, (s, w) in enumerate(zip(self.seeds, self.weights, strict=True)):
                sc = weighted_score(mix64(point ^ s), w)
                if sc > best:
                    second, si, best, bi = best, bi, sc, i
                elif sc > second:
                    second, si = sc, i
        return Placement(self.names[bi], self.names[si] if si >= 0 else None)

    def _top2_among(self, point: int, lanes: Sequence[int]) -> tuple[int, int, float]:
        best = second = -1.0
        bi = si = -1
        for i in lanes:
            z = mix64(point ^ self.seeds[i])
            sc = float(z) if self.equal else weighted_score(z, self.weights[i])
            if sc > best:
                second, si, best, bi = best, bi, sc, i
            elif sc > second:
                second, si = sc, i
        return bi, si, second

    def ranked(self, point: int) -> list[str]:
        """All clusters in this session's preference order (for spill and hot-key spreading)."""
        scored = sorted(zip(self.scores(point), self.names, strict=True), reverse=True)
        return [name for _, name in scored]

    def first_of(self, point: int, lanes: Any) -> str | None:
        """The first cluster of ``ranked(point)`` whose lane is set in ``lanes`` (a numpy bool
        array over ``names``, from :class:`RecentCounts`), or None when none is.

        The set lane with the largest y comes first when its score is above every other set
        lane's bound (as in ``ranked_head``); otherwise the set lanes are scored exactly."""
        import numpy as np

        vector = self._vector
        idx = np.flatnonzero(lanes)
        if idx.size == 0:
            return None
        names, seeds = self.names, self.seeds
        if idx.size == 1:
            return names[int(idx[0])]
        if vector is not None and vector.cuts is None:
            y = vector.premixed(point)[idx]
            j = int(y.argmax())
            yb: int = y.item(j)
            y[j] = 0
            rest_best = y.item(int(y.argmax())) >> _LOW
            if float(yb ^ (yb >> 31)) > float((rest_best + 1) << _LOW):
                return names[int(idx[j])]
        if self.equal:
            best = max((float(mix64(point ^ seeds[i])), names[i]) for i in idx.tolist())
        else:
            best = max(
                (weighted_score(mix64(point ^ seeds[i]), self.weights[i]), names[i])
                for i in idx.tolist()
            )
        first: str = best[1]
        return first

    def ranked_head(self, point: int, k: int) -> list[str]:
        """``ranked(point)[:k]``, exactly, without scoring and sorting every cluster where the
        numpy path can prove which k lanes come first (equal weights; else the full ranking).

        The k lanes with the largest y (see _Vector) are scored and sorted as ``ranked`` does;
        every other lane's z is below (its best top bits + 1) << _LOW, so when the k-th score is
        above that bound no other lane can rank among them, whatever the names' tie rule."""
        n = len(self.names)
        vector = self._vector
        if vector is None or vector.cuts is not None or k >= n or n < HEAD_MIN_CLUSTERS:
            return self.ranked(point)[:k]
        y = vector.premixed(point)
        part = vector.np.argpartition(y, n - k - 1)
        rest_best = y.item(int(part[n - k - 1])) >> _LOW  # the largest y outside the top k
        seeds, names = self.seeds, self.names
        scored = sorted(
            ((float(mix64(point ^ seeds[i])), names[i]) for i in part[n - k :].tolist()),
            reverse=True,
        )
        if scored[-1][0] > float((rest_best + 1) << _LOW):
            return [name for _, name in scored]
        return self.ranked(point)[:k]  # pragma: no cover - a near tie (p ~ k x 2**-31)
