"""Models in the fleet: which clusters serve a requested model, and where one is placed.

A fleet whose clusters list no models is model-agnostic (every request is hashed over its
class's clusters, whatever its ``model`` says): :data:`NO_MODELS`. Otherwise each requested name
resolves to one canonical model — a base model (by its name or an alias) or a LoRA adapter —
and the request is placed by the same weighted rendezvous among the clusters that serve it,
intersected with the class's eligible set. Rendezvous scores a (session, cluster) pair alone,
so a session's placement depends only on its model's clusters: other models' clusters coming
and going move nothing, and within a model the usual properties hold (removing a cluster moves
only its sessions, each to its planned secondary).

An adapter may run on any cluster of its base (engines load LoRA adapters on demand) but is
placed first among the clusters where it is already loaded (:class:`Candidates`): rendezvous
over those, then over the rest of the base's clusters, so the secondary is a loaded cluster
too when there are two.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from extproc.core.placement import Placement, Rendezvous


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a cluster declares: its name, aliases, and the LoRA adapters loaded on it."""

    name: str
    aliases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Model:
    """A canonical model: a base model, or an adapter (``base`` set)."""

    name: str
    clusters: tuple[str, ...]  # that may serve it (an adapter: its base's clusters)
    base: str | None = None
    loaded: tuple[str, ...] = ()  # an adapter: clusters where it is loaded (preferred)
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every model of the fleet, by canonical name, and every requestable name → canonical."""

    models: Mapping[str, Model] = field(default_factory=lambda: MappingProxyType({}))
    names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def enabled(self) -> bool:
        """Whether the fleet is model-aware (some cluster lists models)."""
        return bool(self.names)

    def resolve(self, requested: str) -> Model | None:
        canonical = self.names.get(requested)
        return None if canonical is None else self.models[canonical]

    def served(self) -> list[Model]:
        """The models some cluster serves (the /v1/models union), sorted by name."""
        return sorted((m for m in self.models.values() if m.clusters), key=lambda m: m.name)


NO_MODELS = Catalog()


def build_catalog(
    served: Sequence[tuple[str, Sequence[ServedModel]]],
    declared: Iterable[tuple[str, str | None]] = (),
) -> Catalog:
    """The catalog from each cluster's served models and the fleet-wide declared models
    (``(name, base)``: a model no cluster serves is known but unavailable; an adapter with a
    base is served by the base's clusters). Config validation has rejected ambiguous names
    (one alias for two models, an adapter with two bases); here the first declaration wins."""
    if not any(models for _, models in served):
        return NO_MODELS
    clusters: dict[str, list[str]] = {}
    aliases: dict[str, list[str]] = {}
    bases: dict[str, str] = {}
    loaded: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for cluster, models in served:
        for m in models:
            _add(clusters.setdefault(m.name, []), cluster)
            names.setdefault(m.name, m.name)
            for alias in m.aliases:
                names.setdefault(alias, m.name)
                _add(aliases.setdefault(m.name, []), alias)
            for adapter in m.adapters:
                bases.setdefault(adapter, m.name)
                names.setdefault(adapter, adapter)
                _add(loaded.setdefault(adapter, []), cluster)
    for name, base in declared:
        if base is not None:
            bases.setdefault(name, base)
        names.setdefault(name, name)
    out: dict[str, Model] = {}
    for name in dict.fromkeys(names.values()):
        base = bases.get(name)
        if base is None:
            out[name] = Model(
                name, tuple(clusters.get(name, ())), None, (), tuple(aliases.get(name, ()))
            )
        else:
            out[name] = Model(
                name, tuple(clusters.get(base, ())), base, tuple(loaded.get(name, ()))
            )
    return Catalog(MappingProxyType(out), MappingProxyType(names))


def with_discovered(
    served: Sequence[tuple[str, Sequence[ServedModel]]],
    configured: Catalog,
    discovered: Mapping[str, Iterable[tuple[str, str | None]]],
) -> list[tuple[str, list[ServedModel]]]:
    """The configured served models (the floor) plus what each cluster's endpoints list
    (``(id, parent)`` pairs, vLLM's /v1/models: an adapter names its base in ``parent``).

    The configuration wins on meaning: a listed name it knows resolves as it says (an alias to
    its model, an adapter to its base); a name it does not know is a new model served there,
    or, with a parent, an adapter of that parent loaded there."""
    out = [(cluster, list(models)) for cluster, models in served]
    for cluster, models in out:
        for name, parent in discovered.get(cluster, ()):
            known = configured.resolve(name)
            if known is not None and known.base is None:
                models.append(ServedModel(known.name))
            elif known is not None and known.base is not None:
                models.append(ServedModel(known.base, adapters=(known.name,)))
            elif parent is not None:
                base = configured.resolve(parent)
                models.append(
                    ServedModel(base.name if base is not None else parent, adapters=(name,))
                )
            else:
                models.append(ServedModel(name))
    return out


def loaded_engines(
    catalog: Catalog, listed: Mapping[str, Iterable[tuple[str, str | None]]]
) -> Mapping[str, frozenset[str]]:
    """Adapter (canonical name) -> the endpoints whose own model list names it: where it is
    loaded now, preferred inside a cluster (core.endpoints.pick_engine). ``listed``: each
    endpoint's ``(id, parent)`` pairs (model discovery); names resolve by ``catalog`` (the one
    with the discoveries, so an adapter only discovery knows counts too)."""
    out: dict[str, set[str]] = {}
    for endpoint, pairs in listed.items():
        for name, _parent in pairs:
            model = catalog.resolve(name)
            if model is not None and model.base is not None:
                out.setdefault(model.name, set()).add(endpoint)
    return MappingProxyType({name: frozenset(eps) for name, eps in out.items()})


# The pool data path's per-model Envoy clusters (render/envoy.py _model_pools). Fleet cluster
# names are [a-z0-9-] and pair aggregates "<a>__<b>": a leading underscore cannot collide.
MODEL_POOL_PREFIX = "_pool_"


@dataclass(frozen=True, slots=True)
class ModelPool:
    """One base model's pool in the linear-scale design: its Envoy cluster and the fleet
    clusters whose endpoints it holds."""

    name: str
    clusters: frozenset[str]


def model_pool_name(model: str) -> str:
    """The Envoy cluster name of a base model's pool: readable and unique (a hash of the full
    name, since the slug folds characters Envoy's stat names should not carry)."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:40]
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{MODEL_POOL_PREFIX}{slug}_{digest}"


def model_pools(catalog: Catalog) -> Mapping[str, ModelPool]:
    """Canonical model -> its pool: a base model's own, an adapter its base's (one pool per
    base model, as the Inference Extension's InferencePool). Models with no cluster have none."""
    out: dict[str, ModelPool] = {}
    for model in catalog.models.values():
        base = model.base or model.name
        if model.clusters:
            out[model.name] = ModelPool(model_pool_name(base), frozenset(model.clusters))
    return MappingProxyType(out)


def _add(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


@dataclass(frozen=True, slots=True)
class Candidates:
    """Where one (class, model) may be placed: rendezvous over ``preferred`` (an adapter's
    loaded clusters), then over ``rest``. Same interface as :class:`Rendezvous`."""

    preferred: Rendezvous | None
    rest: Rendezvous | None
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        first = self.preferred.names if self.preferred is not None else ()
        rest = self.rest.names if self.rest is not None else ()
        if not first and not rest:
            raise ValueError("candidates need at least one cluster")
        object.__setattr__(self, "names", first + rest)

    def top2(self, point: int) -> Placement:
        if self.preferred is None:
            assert self.rest is not None
            return self.rest.top2(point)
        head = self.preferred.top2(point)
        if head.secondary is not None or self.rest is None:
            return head
        return Placement(head.primary, self.rest.top2(point).primary)

    def ranked(self, point: int) -> list[str]:
        first = self.preferred.ranked(point) if self.preferred is not None else []
        return first + (self.rest.ranked(point) if self.rest is not None else [])

    def ranked_head(self, point: int, k: int) -> list[str]:
        """``ranked(point)[:k]`` (Rendezvous.ranked_head on each tier)."""
        first = self.preferred.ranked_head(point, k) if self.preferred is not None else []
        if len(first) >= k or self.rest is None:
            return first
        return first + self.rest.ranked_head(point, k - len(first))


def candidates(
    model: Model, eligible: Sequence[str], weights: Mapping[str, float]
) -> Candidates | None:
    """The model's clusters within a class's eligible set (empty: every cluster), or None when
    that leaves none."""
    allowed = set(eligible) if eligible else None
    pool = [c for c in model.clusters if c in weights and (allowed is None or c in allowed)]
    if not pool:
        return None
    first = [c for c in pool if c in model.loaded]
    rest = [c for c in pool if c not in model.loaded]
    return Candidates(_rendezvous(first, weights), _rendezvous(rest, weights))


def _rendezvous(names: Sequence[str], weights: Mapping[str, float]) -> Rendezvous | None:
    return Rendezvous.of([(n, weights[n]) for n in names]) if names else None


@dataclass(frozen=True, slots=True)
class UnknownModel:
    """The request names a model no cluster of this fleet serves or declares: 404."""

    requested: str

    @property
    def message(self) -> str:
        if not self.requested:
            return "you must provide a model parameter"
        return f"The model `{self.requested}` does not exist"


@dataclass(frozen=True, slots=True)
class ModelUnavailable:
    """A known model with no cluster to place it on (none serves it, none in the class's
    eligible set, or none ready): 503 with a retry hint."""

    model: str
    class_name: str
    retry_after_s: int

    @property
    def message(self) -> str:
        return (
            f"no cluster is available for model `{self.model}` "
            f"(request class '{self.class_name}'); retry later"
        )


ModelMiss = UnknownModel | ModelUnavailable


# GET /v1/models (and /v1/models/{id}): a model-aware fleet answers it itself, for the union
# of what its clusters serve; any one cluster would list only its own models.
MODELS_PATH = "/v1/models"


def _entries(catalog: Catalog) -> list[tuple[str, Model]]:
    """Every requestable name some cluster serves, with its model (aliases listed apart, as
    vLLM lists each --served-model-name)."""
    out: list[tuple[str, Model]] = []
    for model in catalog.served():
        out.append((model.name, model))
        out.extend((alias, model) for alias in model.aliases)
    return sorted(out, key=lambda e: e[0])


def _openai_object(name: str, model: Model) -> dict[str, object]:
    # OpenAI's fields, plus vLLM's root / parent (an adapter's parent is its base model).
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "fleet-extproc",
        "root": model.name,
        "parent": model.base,
    }


def _anthropic_object(name: str) -> dict[str, object]:
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}


def model_list(catalog: Catalog, anthropic: bool) -> dict[str, object]:
    """The /v1/models answer in OpenAI's list format, or Anthropic's when the client speaks it."""
    entries = _entries(catalog)
    if anthropic:
        names = [name for name, _ in entries]
        return {
            "data": [_anthropic_object(n) for n in names],
            "has_more": False,
            "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None,
        }
    return {"object": "list", "data": [_openai_object(n, m) for n, m in entries]}


def model_object(catalog: Catalog, name: str, anthropic: bool) -> dict[str, object] | None:
    """/v1/models/{name}: the one model, or None (404) when no cluster serves that name."""
    for entry, model in _entries(catalog):
        if entry == name:
            return _anthropic_object(name) if anthropic else _openai_object(name, model)
    return None
