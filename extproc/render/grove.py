"""Disaggregated replicas as NVIDIA Grove ``PodCliqueSet``s, placed by a topology-aware scheduler.

``extproc gateway --disagg grove`` renders, for a fleet whose clusters have P/D roles:

- one ``ClusterTopologyBinding`` (``grove.io/v1alpha1``, cluster-scoped) whose levels are the
  fleet's ``topology.levels`` from broadest to narrowest (island, NVLink domain), then ``host``
  (``kubernetes.io/hostname``); each level's node-label key is the one the lws rendering pins
  pods with (``fleet-extproc.io/<level>``). With ``--kai-topology`` the binding names the KAI
  ``Topology`` it is bound to (``schedulerTopologyBindings``); without it Grove creates KAI's
  topology from the levels;
- one ``PodCliqueSet`` per island (the widest level's label value), required to pack into one
  island (``topologyConstraint.pack.required`` on the set);
- one clique per fleet cluster of that island, ``roleName`` its role (``prefill`` or
  ``decode``), one pod per endpoint, labelled as the lws rendering labels its pods
  (``fleet-extproc.io/{cluster,role,<level>}``), so selectors and metrics read them the same;
- per NVLink domain of the island, a ``PodCliqueScalingGroup`` of its cliques, required to pack
  into one NVLink domain, and the same requirement on each of those cliques: the clusters the
  router takes as sharing an NVLink domain are the ones the scheduler must put in one;
- with ``--grove-router`` a ``router`` clique per set (Envoy and the processor in one pod,
  Envoy's bootstrap as ``extproc envoy`` renders it), in place of a Gateway in front;
- with ``--scheduler kai``, ``schedulerName: kai-scheduler`` on every pod and the KAI queue
  label on the set.

What the scheduler is required to keep together is what the router assumes (``core/pd``):
two clusters whose narrowest shared label is the NVLink domain are in one scaling group packed
at that domain, two that share only the island are in one set packed at the island, and pairs
sharing no label are in different sets (``cross``: the router costs them at the spine's
bandwidth). ``tests/unit/test_grove_render.py`` checks this over random topologies.

The two levels are the whole model: Grove packs a set and, inside it, scaling groups and
cliques, so a third level between them could not be required. A fleet with more levels is
refused. An example to adapt (images, resources, model), validated offline against the
vendored CRD schemas (third_party/crds/grove/).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import yaml

from extproc.config.runtime import Runtime
from extproc.config.schema import ClusterConfig, FleetConfig
from extproc.render.disagg import LABEL_PREFIX, engine_containers, node_label, pod_labels
from extproc.render.envoy import EnvoyOptions, render_bootstrap
from extproc.render.gateway import DEFAULT_IMAGE, PROCESSOR, GatewayOptions, processor_container

Json = dict[str, Any]

API_VERSION = "grove.io/v1alpha1"
BINDING = "fleet-topology"
HOST_DOMAIN = "host"
HOST_KEY = "kubernetes.io/hostname"
KAI_SCHEDULER = "kai-scheduler"
KAI_QUEUE_LABEL = "kai.scheduler/queue"
ROUTER = "router"
ENVOY_IMAGE = "envoyproxy/envoy:distroless-v1.40.0"
ENVOY_CONFIG = "fleet-envoy"
ENVOY_DIR = "/etc/envoy"
ROUTER_SERVICE = "fleet-router"
# Grove topology domains: lowercase DNS-label style, starting with a letter (CRD pattern).
_DOMAIN = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class GroveRenderError(ValueError):
    """The fleet cannot be expressed as Grove PodCliqueSets."""


@dataclass(frozen=True, slots=True)
class GroveOptions:
    namespace: str = "fleet"
    # The processor's image (the router clique).
    image: str = DEFAULT_IMAGE
    # "kai": pods scheduled by KAI (schedulerName kai-scheduler, the set in queue kai_queue).
    scheduler: str = "default"
    kai_queue: str = "default-queue"
    # An existing KAI Topology the binding is bound to; None: Grove creates it from the levels.
    kai_topology: str | None = None
    # Envoy and the processor as a clique of every set, instead of a Gateway in front.
    router: bool = False


@dataclass(frozen=True, slots=True)
class CliquePlace:
    """Where a fleet cluster runs in the Grove rendering, and what holds its pods together."""

    podcliqueset: str
    clique: str
    # The NVLink domain's scaling group (None: the cluster has no NVLink-level label).
    scaling_group: str | None
    # The narrowest domain all of its pods are required to share.
    pack: str
    # Its topology labels, level name -> label value (as fleet.yaml gives them).
    topology: dict[str, str]


@dataclass(frozen=True, slots=True)
class GroveLayout:
    """Sets (name -> island value, clusters), scaling groups per set, and each cluster's place."""

    island: str
    nvlink: str | None
    sets: dict[str, tuple[str, list[ClusterConfig]]]
    groups: dict[str, dict[str, list[str]]]
    places: dict[str, CliquePlace]


def domain(level: str) -> str:
    """The Grove topology domain of a fleet topology level (its name, if Grove accepts it)."""
    if not _DOMAIN.match(level):
        raise GroveRenderError(
            f"topology level {level!r}: a Grove topology domain is lowercase letters, digits "
            "and '-', starting with a letter"
        )
    return level


def _name(text: str, what: str) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", text.lower())
    if not _DNS_LABEL.match(name):
        raise GroveRenderError(f"{what} {text!r} gives no valid Kubernetes name ({name!r})")
    return name


def layout(cfg: FleetConfig) -> GroveLayout:
    """The sets, scaling groups and clique of every cluster; raises GroveRenderError."""
    levels = [lvl.name for lvl in cfg.topology.levels]
    if not 1 <= len(levels) <= 2:
        raise GroveRenderError(
            f"Grove packs a set at the island and its cliques at the NVLink domain: "
            f"topology.levels needs 1 or 2 levels, has {len(levels)}"
        )
    for level in levels:
        domain(level)
    island, nvlink = levels[-1], (levels[0] if len(levels) == 2 else None)
    by_island: dict[str, list[ClusterConfig]] = defaultdict(list)
    for cluster in cfg.clusters:
        value = cluster.topology.get(island)
        if value is None:
            raise GroveRenderError(f"cluster {cluster.name!r} has no {island!r} topology label")
        by_island[value].append(cluster)
    sets: dict[str, tuple[str, list[ClusterConfig]]] = {}
    groups: dict[str, dict[str, list[str]]] = {}
    places: dict[str, CliquePlace] = {}
    for value, clusters in sorted(by_island.items()):
        set_name = _name(f"fleet-{value}", f"island {island}")
        if set_name in sets:
            raise GroveRenderError(f"islands {sets[set_name][0]!r} and {value!r} share a name")
        sets[set_name] = (value, clusters)
        set_groups: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for cluster in clusters:
            if cluster.name == ROUTER:
                raise GroveRenderError(f"cluster name {ROUTER!r} is the router clique's")
            domain_value = cluster.topology.get(nvlink) if nvlink else None
            group = None
            if domain_value is not None:
                group = _name(domain_value, f"{nvlink} label")
                if owner.setdefault(group, domain_value) != domain_value:
                    raise GroveRenderError(
                        f"{nvlink} labels {owner[group]!r} and {domain_value!r} share a name"
                    )
                set_groups.setdefault(group, []).append(cluster.name)
            places[cluster.name] = CliquePlace(
                podcliqueset=set_name,
                clique=cluster.name,
                scaling_group=group,
                pack=nvlink if group is not None and nvlink else island,
                topology=dict(cluster.topology),
            )
        groups[set_name] = set_groups
    return GroveLayout(island, nvlink, sets, groups, places)


def render_topology_binding(runtime: Runtime, opts: GroveOptions) -> Json:
    """Broadest to narrowest: the fleet's levels reversed, then the host."""
    levels = [lvl.name for lvl in reversed(runtime.config.topology.levels)]
    spec: Json = {
        "levels": [{"domain": domain(lvl), "key": node_label(lvl)} for lvl in levels]
        + ([] if HOST_DOMAIN in levels else [{"domain": HOST_DOMAIN, "key": HOST_KEY}])
    }
    if opts.scheduler == "kai" and opts.kai_topology:
        spec["schedulerTopologyBindings"] = [
            {"schedulerName": KAI_SCHEDULER, "topologyReference": opts.kai_topology}
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterTopologyBinding",
        "metadata": {"name": BINDING, "labels": {f"{LABEL_PREFIX}fleet": "extproc"}},
        "spec": spec,
    }


def _pod_spec(containers: list[Json], opts: GroveOptions, **extra: Any) -> Json:
    spec: Json = {"containers": containers, **extra}
    if opts.scheduler == "kai":
        spec["schedulerName"] = KAI_SCHEDULER
    return spec


def _clique(cluster: ClusterConfig, place: CliquePlace, opts: GroveOptions) -> Json:
    clique: Json = {
        "name": place.clique,
        "labels": pod_labels(cluster),
        "spec": {
            "roleName": cluster.role,
            # One pod per endpoint of fleet.yaml (one engine instance each); one is enough to
            # serve, so the gang does not end when another pod dies.
            "replicas": len(cluster.endpoints),
            "minAvailable": 1,
            "podSpec": _pod_spec(engine_containers(cluster), opts),
        },
    }
    if place.scaling_group is not None:
        clique["topologyConstraint"] = {"pack": {"required": place.pack}}
    return clique


def _router_clique(runtime: Runtime, opts: GroveOptions) -> Json:
    port = runtime.config.listener.port
    envoy = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "args": ["-c", f"{ENVOY_DIR}/envoy.yaml"],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": [{"name": "envoy", "mountPath": ENVOY_DIR, "readOnly": True}],
    }
    # The processor container mounts the fleet.yaml ConfigMap as volume "config".
    processor = processor_container(
        runtime, GatewayOptions(namespace=opts.namespace, image=opts.image)
    )
    return {
        "name": ROUTER,
        "labels": {f"{LABEL_PREFIX}role": ROUTER},
        "spec": {
            "roleName": ROUTER,
            "replicas": 1,
            "minAvailable": 1,
            "podSpec": _pod_spec(
                [envoy, processor],
                opts,
                volumes=[
                    {"name": "config", "configMap": {"name": PROCESSOR}},
                    {"name": "envoy", "configMap": {"name": ENVOY_CONFIG}},
                ],
            ),
        },
    }


def render_pod_clique_sets(runtime: Runtime, opts: GroveOptions) -> list[Json]:
    """One PodCliqueSet per island: packed at the island, its NVLink domains' cliques each a
    scaling group packed at the NVLink domain."""
    plan = layout(runtime.config)
    by_name = {c.name: c for c in runtime.config.clusters}
    out: list[Json] = []
    for set_name, (value, clusters) in plan.sets.items():
        cliques = [_clique(by_name[c.name], plan.places[c.name], opts) for c in clusters]
        if opts.router:
            cliques.append(_router_clique(runtime, opts))
        template: Json = {
            "topologyConstraint": {"topologyName": BINDING, "pack": {"required": plan.island}},
            "cliques": cliques,
        }
        if plan.groups[set_name]:
            template["podCliqueScalingGroups"] = [
                {
                    "name": group,
                    "cliqueNames": names,
                    "replicas": 1,
                    "minAvailable": 1,
                    "topologyConstraint": {"pack": {"required": plan.nvlink}},
                }
                for group, names in sorted(plan.groups[set_name].items())
            ]
        labels = {f"{LABEL_PREFIX}{plan.island}": value}
        if opts.scheduler == "kai":
            labels[KAI_QUEUE_LABEL] = opts.kai_queue
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "PodCliqueSet",
                "metadata": {"name": set_name, "namespace": opts.namespace, "labels": labels},
                "spec": {"replicas": 1, "template": template},
            }
        )
    return out


def render_router_parts(runtime: Runtime, opts: GroveOptions) -> list[Json]:
    """With the router inside the sets: Envoy's bootstrap (Envoy listening on the pod's
    address, the processor on loopback beside it) and a Service over every set's router."""
    cfg = runtime.config
    proc, listener = cfg.processor, cfg.listener
    envoy_opts = EnvoyOptions(
        host_map=(
            (f"{proc.address}:{proc.port}", f"127.0.0.1:{proc.port}"),
            (f"{listener.address}:{listener.port}", f"0.0.0.0:{listener.port}"),
        )
    )
    bootstrap = yaml.safe_dump(render_bootstrap(runtime, envoy_opts), sort_keys=False, width=120)
    labels = {"app.kubernetes.io/name": PROCESSOR, "app.kubernetes.io/component": ROUTER}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": ENVOY_CONFIG, "namespace": opts.namespace, "labels": labels},
            "data": {"envoy.yaml": bootstrap},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ROUTER_SERVICE, "namespace": opts.namespace, "labels": labels},
            "spec": {
                "type": "ClusterIP",
                "selector": {f"{LABEL_PREFIX}role": ROUTER},
                "ports": [
                    {"name": "http", "port": listener.port, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        },
    ]


def check_router_replicas(runtime: Runtime) -> None:
    """Every set runs one processor: the ledger's outage share divides by redis.replicas."""
    n_sets = len(layout(runtime.config).sets)
    if runtime.config.redis.replicas != n_sets:
        raise GroveRenderError(
            f"--grove-router runs one processor per set ({n_sets}): set redis.replicas to "
            f"{n_sets} (it is {runtime.config.redis.replicas})"
        )


def render_grove(runtime: Runtime, opts: GroveOptions) -> list[Json]:
    """The binding, then the sets (and with the router clique, its Envoy config and Service)."""
    if opts.router:
        check_router_replicas(runtime)
    objs = [render_topology_binding(runtime, opts)]
    if opts.router:
        objs += render_router_parts(runtime, opts)
    return objs + render_pod_clique_sets(runtime, opts)


def describe_end(cfg: FleetConfig, cluster: str) -> dict[str, object]:
    """One end of a P/D pair as ``explain`` names it: its topology domains, and the Grove clique
    and the domain its pods are packed in (None where the fleet has no Grove rendering)."""
    by_name = {c.name: c for c in cfg.clusters}
    end: dict[str, object] = {
        "cluster": cluster,
        "role": by_name[cluster].role,
        "topology": dict(by_name[cluster].topology),
    }
    try:
        place = layout(cfg).places[cluster]
    except GroveRenderError:
        end["grove"] = None
        return end
    end["grove"] = {
        "podcliqueset": place.podcliqueset,
        "clique": place.clique,
        "scaling_group": place.scaling_group,
        "pack_required": place.pack,
        "pack_domain": place.topology.get(place.pack),
    }
    return end


def packed_together(cfg: FleetConfig, a: str, b: str) -> dict[str, str] | None:
    """The narrowest level (and its label) the Grove rendering requires clusters ``a`` and
    ``b`` to share: their scaling group's NVLink domain, else their set's island; None when
    they are in different sets or the fleet has no Grove rendering."""
    try:
        plan = layout(cfg)
    except GroveRenderError:
        return None
    pa, pb = plan.places[a], plan.places[b]
    if pa.podcliqueset != pb.podcliqueset:
        return None
    shared_group = pa.scaling_group is not None and pa.scaling_group == pb.scaling_group
    if plan.nvlink is not None and shared_group:
        return {"level": plan.nvlink, "domain": pa.topology[plan.nvlink]}
    return {"level": plan.island, "domain": pa.topology[plan.island]}
