"""Hot affinity keys: a decayed estimate of each key's share of its cluster's request load.

A key is charged to its *hash primary* (the cluster pure consistent hashing gives it), not to
the cluster that finally served it. That keeps the estimate independent of the placement it
drives: spreading a hot key over several clusters lowers its load on any one of them, and a
share measured against the serving cluster would then fall below the threshold, concentrate the
key again and flap. Against the hash primary the share stays what it is until the traffic
itself changes.

Rates are exponentially decayed counts with a half-life, kept with forward decay (Cormode et
al.): an event at time t adds ``w * 2**((t - L) / h)`` to a stored value, for a landmark L, and
a value is read by scaling with ``2**(-(now - L) / h)``. Every update is O(1) with no sweep over
the other keys; the landmark moves forward before the scale factor could overflow. A steady
stream of r requests/s settles at ``r * h / ln 2``: the requests of the last ~1.44 half-lives.

Memory is bounded: when the table holds twice ``max_keys`` keys it keeps the ``max_keys``
heaviest. A key heavy enough to be hot is never among those dropped.

Pure: no clock reads (every call takes ``now``), no I/O. The shell owns one instance.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

# Move the landmark once the scale factor reaches 2**256: far from float overflow (2**1024)
# even after multiplying by large weights, and rare (every 256 half-lives).
_REBASE_EXPONENT = 256.0


@dataclass(slots=True)
class _Entry:
    cluster: str
    scaled: float


class HotKeys:
    def __init__(self, half_life_s: float, max_keys: int = 4096) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self.half_life_s = half_life_s
        self.max_keys = max_keys
        self._landmark: float | None = None
        self._keys: dict[Hashable, _Entry] = {}
        self._clusters: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def _scale(self, now: float) -> float:
        if self._landmark is None:
            self._landmark = now
        exponent = (now - self._landmark) / self.half_life_s
        if exponent > _REBASE_EXPONENT:
            self._rebase(now)
            exponent = 0.0
        return math.pow(2.0, exponent)

    def _rebase(self, now: float) -> None:
        assert self._landmark is not None
        factor = math.pow(2.0, -(now - self._landmark) / self.half_life_s)
        for entry in self._keys.values():
            entry.scaled *= factor
        for name in self._clusters:
            self._clusters[name] *= factor
        self._landmark = now

    def observe(self, key: Hashable, cluster: str, now: float, weight: float = 1.0) -> None:
        """One request of ``key``, whose hash primary is ``cluster``."""
        add = weight * self._scale(now)
        entry = self._keys.get(key)
        if entry is None or entry.cluster != cluster:
            # A key whose hash primary changed (fleet membership changed) starts over there.
            self._keys[key] = _Entry(cluster, add)
        else:
            entry.scaled += add
        self._clusters[cluster] = self._clusters.get(cluster, 0.0) + add
        if len(self._keys) >= 2 * self.max_keys:
            self._prune()

    def _prune(self) -> None:
        heaviest = sorted(self._keys.items(), key=lambda kv: kv[1].scaled, reverse=True)
        self._keys = dict(heaviest[: self.max_keys])

    def volume(self, key: Hashable, now: float) -> float:
        """The key's decayed request count."""
        entry = self._keys.get(key)
        return 0.0 if entry is None else entry.scaled / self._scale(now)

    def share(self, key: Hashable, cluster: str, now: float, min_volume: float = 0.0) -> float:
        """The key's share of the load hashed to ``cluster`` (0..1); 0 below ``min_volume``.

        The floor keeps a quiet cluster from calling its only recent key "hot": two requests
        out of three is a large share of nothing.
        """
        entry = self._keys.get(key)
        if entry is None or entry.cluster != cluster:
            return 0.0
        total = self._clusters.get(cluster, 0.0)
        if total <= 0.0 or entry.scaled / self._scale(now) < min_volume:
            return 0.0
        return min(1.0, entry.scaled / total)

    def share_if_observed(
        self, key: Hashable, cluster: str, now: float, min_volume: float = 0.0
    ) -> float:
        """What :meth:`share` would answer right after ``observe(key, cluster, now)``, without
        recording anything: ``explain`` previews a decision on live state and must see the
        number the live request would see."""
        add = self._scale(now)
        entry = self._keys.get(key)
        scaled = add + (entry.scaled if entry is not None and entry.cluster == cluster else 0.0)
        total = self._clusters.get(cluster, 0.0) + add
        if scaled / add < min_volume:
            return 0.0
        return min(1.0, scaled / total)
