"""The N tenants with the most served tokens, in bounded memory (Space-Saving).

Per-tenant metrics must not grow a label per tenant: a fleet keyed by API key may see millions.
This keeps at most N tenants, by their keyed label (never their names). One that arrives when
the table is full takes the place of the least-served, and ranks as if it had that one's count
too (Space-Saving, Metwally et al.: a tenant that was served more than total / N is always in
the table); what the evicted one had moves to "other". The exported counts are exact: a row's
tokens are what it was served since it entered the table, so top plus other is everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OTHER = "other"


@dataclass(slots=True)
class _Row:
    tokens: float = 0.0
    requests: int = 0
    floor: float = 0.0  # the count it inherited on entry: for ranking only

    @property
    def rank(self) -> float:
        return self.floor + self.tokens


@dataclass(slots=True)
class TopTenants:
    capacity: int
    _rows: dict[str, _Row] = field(default_factory=dict)
    _other: _Row = field(default_factory=_Row)

    def add(self, label: str, tokens: float, requests: int = 0) -> None:
        row = self._rows.get(label)
        if row is None:
            row = _Row()
            if len(self._rows) >= self.capacity:
                least = min(self._rows, key=lambda k: self._rows[k].rank)
                gone = self._rows.pop(least)
                self._other.tokens += gone.tokens
                self._other.requests += gone.requests
                row.floor = gone.rank
            self._rows[label] = row
        row.tokens += tokens
        row.requests += requests

    def rows(self) -> list[tuple[str, float, int]]:
        """(label, tokens, requests), the most served first, then "other"."""
        ranked = sorted(self._rows.items(), key=lambda kv: -kv[1].rank)
        out = [(k, r.tokens, r.requests) for k, r in ranked]
        return [*out, (OTHER, self._other.tokens, self._other.requests)]
