"""facts + fleet policy -> where the request goes (and, with admission, whether it may go now)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from extproc.core.facts import RequestFacts
from extproc.core.fleet import RequestClass, classify
from extproc.core.models import (
    NO_MODELS,
    Candidates,
    Catalog,
    ModelMiss,
    ModelUnavailable,
    UnknownModel,
)
from extproc.core.placement import Placement, Rendezvous


class Placer(Protocol):
    """Rendezvous over a set of clusters (:class:`Rendezvous`, or a model's :class:`Candidates`)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    def top2(self, point: int) -> Placement: ...

    def ranked(self, point: int) -> list[str]: ...

    def ranked_head(self, point: int, k: int) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Route:
    placement: Placement
    request_class: RequestClass
    # The canonical model (extproc.core.models); "" in a model-agnostic fleet.
    model: str = ""


def _no_placers() -> Mapping[tuple[str, str], Candidates]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Policy:
    classes: tuple[RequestClass, ...]
    # One placer per class: a class restricted to eligible clusters hashes within that subset.
    placers: Mapping[str, Rendezvous]
    models: Catalog = NO_MODELS
    # Model-aware fleets: one placer per (class, canonical model) that has a cluster to go to.
    model_placers: Mapping[tuple[str, str], Candidates] = field(default_factory=_no_placers)
    # (class, model) pairs with their own budget: the class as admission sees it for them.
    model_classes: Mapping[tuple[str, str], RequestClass] = field(
        default_factory=lambda: MappingProxyType({})
    )
    unavailable_retry_after_s: int = 5

    def classify(self, facts: RequestFacts) -> RequestClass:
        return classify(self.classes, facts.input_tokens, facts.tier)

    def all_classes(self) -> tuple[RequestClass, ...]:
        """The classes as admission sees them: fleet.yaml's, then each model's own budget of
        one ("<class>@<model>"), each its own ledger compartment."""
        return self.classes + tuple(self.model_classes.values())

    def class_named(self, name: str) -> RequestClass | None:
        return next((c for c in self.all_classes() if c.name == name), None)

    def clusters_of(self, cls: RequestClass, all_clusters: tuple[str, ...]) -> tuple[str, ...]:
        """The clusters a class (or a model's class) may place on: its compartments."""
        base, _, model = cls.name.partition("@")
        if model:
            placer = self.model_placers.get((base, model))
            return placer.names if placer is not None else ()
        return cls.eligible or all_clusters

    def placer(self, route: Route) -> Placer:
        """The clusters the route was chosen among, for ranking (spill, endpoint fallback)."""
        if not route.model:
            return self.placers[route.request_class.name]
        return self.model_placers[(base_class_name(route.request_class), route.model)]

    def place(self, facts: RequestFacts) -> Route | ModelMiss:
        cls = self.classify(facts)
        if not self.models.enabled:
            return Route(self.placers[cls.name].top2(facts.session.point), cls)
        model = self.models.resolve(facts.model)
        if model is None:
            return UnknownModel(facts.model)
        placer = self.model_placers.get((cls.name, model.name))
        if placer is None:
            return ModelUnavailable(model.name, cls.name, self.unavailable_retry_after_s)
        cls = self.model_classes.get((cls.name, model.name), cls)
        return Route(placer.top2(facts.session.point), cls, model.name)

    def route(self, facts: RequestFacts) -> Route:
        """:meth:`place` for callers that only send models the fleet serves (tools, tests)."""
        routed = self.place(facts)
        if isinstance(routed, (UnknownModel, ModelUnavailable)):
            raise LookupError(routed.message)
        return routed


def base_class_name(cls: RequestClass) -> str:
    """The fleet.yaml class a request class is: a model's own budget of class C is a class
    named "<C>@<model>" (its own ledger compartment), which is still C for everything else."""
    return cls.name.split("@", 1)[0]
