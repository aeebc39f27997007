"""facts + fleet policy -> where the request goes (and, with admission, whether it may go now)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.core.facts import RequestFacts
from extproc.core.fleet import RequestClass, classify
from extproc.core.placement import Placement, Rendezvous


@dataclass(frozen=True, slots=True)
class Route:
    placement: Placement
    request_class: RequestClass


@dataclass(frozen=True, slots=True)
class Policy:
    classes: tuple[RequestClass, ...]
    # One placer per class: a class restricted to eligible clusters hashes within that subset.
    placers: Mapping[str, Rendezvous]

    def classify(self, facts: RequestFacts) -> RequestClass:
        return classify(self.classes, facts.input_tokens, facts.tier)

    def route(self, facts: RequestFacts) -> Route:
        cls = self.classify(facts)
        return Route(self.placers[cls.name].top2(facts.session.point), cls)
