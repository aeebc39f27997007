"""An example disaggregated serving replica per topology island, as lws ``DisaggregatedSet``s.

For a fleet whose clusters have P/D roles (``role: prefill | decode``) ``extproc gateway``
appends one ``DisaggregatedSet`` (``disaggregatedset.x-k8s.io/v1``) per value of the widest
topology level (the island), with one role per fleet cluster of that island:

- each role is a LeaderWorkerSet template whose replicas are the cluster's endpoints (one
  leader/worker group = one engine instance = one endpoint of fleet.yaml);
- the set's ``placementPolicy`` is ``ExclusiveTopology`` on the island's node label: the
  controller co-locates the roles of a slice in one island and keeps other slices out of it;
- the narrower levels (e.g. the NVLink domain) become a ``nodeSelector`` on the role's pods;
- decode pods run llm-d's routing sidecar in front of vLLM (the sidecar reads the processor's
  ``x-prefiller-host-port``), prefill pods run vLLM alone; both with vLLM's NixlConnector;
- every pod template carries the labels the fleet is derived from: ``fleet-extproc.io/cluster``,
  ``fleet-extproc.io/role`` and one ``fleet-extproc.io/<level>`` per topology level (the
  processor's fleet.yaml: cluster name, role, ``topology`` labels; the endpoints are the pods).

An example to adapt (images, resources, model, tensor parallelism), validated offline against
the vendored CRD schema (third_party/crds/lws/).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from extproc.config.runtime import Runtime
from extproc.config.schema import ClusterConfig
from extproc.names import PREFILL_MIRROR_HEADER, prefill_mirror_cluster

Json = dict[str, Any]

API_VERSION = "disaggregatedset.x-k8s.io/v1"
LABEL_PREFIX = "fleet-extproc.io/"
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
SIDECAR_IMAGE = "ghcr.io/llm-d/llm-d-routing-sidecar:v0.3.0"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
# DisaggregatedSet: 2-10 roles per set (CRD).
MIN_ROLES, MAX_ROLES = 2, 10
SERVE_PORT = 8000
# Behind the sidecar, vLLM listens here (the sidecar's --vllm-port).
DECODE_ENGINE_PORT = 8200
KV_CONFIG = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


class DisaggRenderError(ValueError):
    """The fleet cannot be expressed as DisaggregatedSets."""


def node_label(level: str) -> str:
    """The node-label key of a topology level (nodes carry it with the fleet's label value)."""
    return f"{LABEL_PREFIX}{level}"


def has_roles(runtime: Runtime) -> bool:
    return any(c.role != "both" for c in runtime.config.clusters)


def _vllm(args: list[str], port: int, port_name: str) -> Json:
    return {
        "name": "vllm",
        "image": VLLM_IMAGE,
        "args": [
            MODEL,
            "--port",
            str(port),
            "--kv-transfer-config",
            KV_CONFIG,
            *args,
        ],
        "ports": [{"containerPort": port, "name": port_name}],
        "resources": {"limits": {"nvidia.com/gpu": 8}},
    }


def _sidecar() -> Json:
    return {
        "name": "routing-sidecar",
        "image": SIDECAR_IMAGE,
        "args": [
            f"--port={SERVE_PORT}",
            f"--vllm-port={DECODE_ENGINE_PORT}",
            "--connector=nixlv2",
        ],
        "ports": [{"containerPort": SERVE_PORT, "name": "http"}],
    }


def pod_labels(cluster: ClusterConfig) -> dict[str, str]:
    """The labels the fleet is read back from: cluster name, role, one per topology level."""
    return {
        f"{LABEL_PREFIX}cluster": cluster.name,
        f"{LABEL_PREFIX}role": cluster.role,
        **{f"{LABEL_PREFIX}{k}": v for k, v in cluster.topology.items()},
    }


def engine_containers(cluster: ClusterConfig) -> list[Json]:
    """Prefill pods run vLLM alone; decode pods llm-d's routing sidecar in front of vLLM."""
    if cluster.role == "prefill":
        return [_vllm([], SERVE_PORT, "http")]
    # Port names are unique per pod: the sidecar serves "http", vLLM behind it "engine".
    return [_sidecar(), _vllm([], DECODE_ENGINE_PORT, "engine")]


def _pod_template(cluster: ClusterConfig, levels: list[str]) -> Json:
    labels = pod_labels(cluster)
    spec: Json = {"containers": engine_containers(cluster)}
    narrower = {
        node_label(lvl): cluster.topology[lvl] for lvl in levels[:-1] if lvl in cluster.topology
    }
    if narrower:
        # Narrower than the island: the role's pods share one NVLink domain.
        spec["nodeSelector"] = narrower
    return {"metadata": {"labels": labels}, "spec": spec}


def _role(cluster: ClusterConfig, levels: list[str]) -> Json:
    return {
        "name": cluster.name,
        "metadata": {"labels": {f"{LABEL_PREFIX}role": cluster.role}},
        "spec": {
            "replicas": len(cluster.endpoints),
            "rolloutStrategy": {"type": "RollingUpdate"},
            "leaderWorkerTemplate": {
                "size": 1,
                "workerTemplate": _pod_template(cluster, levels),
            },
        },
    }


def render_disaggregated_sets(runtime: Runtime, namespace: str) -> list[Json]:
    """One DisaggregatedSet per island (the widest topology level's label value)."""
    cfg = runtime.config
    levels = [lvl.name for lvl in cfg.topology.levels]
    if not levels:
        raise DisaggRenderError("P/D roles need topology.levels to place DisaggregatedSets")
    island = levels[-1]
    by_island: dict[str, list[ClusterConfig]] = defaultdict(list)
    for cluster in cfg.clusters:
        value = cluster.topology.get(island)
        if value is None:
            raise DisaggRenderError(f"cluster {cluster.name!r} has no {island!r} topology label")
        by_island[value].append(cluster)
    out: list[Json] = []
    for value, clusters in sorted(by_island.items()):
        if not MIN_ROLES <= len(clusters) <= MAX_ROLES:
            raise DisaggRenderError(
                f"island {value!r} has {len(clusters)} clusters; a DisaggregatedSet takes "
                f"{MIN_ROLES}-{MAX_ROLES} roles"
            )
        out.append(
            {
                "apiVersion": API_VERSION,
                "kind": "DisaggregatedSet",
                "metadata": {
                    "name": f"fleet-{value}".lower(),
                    "namespace": namespace,
                    "labels": {f"{LABEL_PREFIX}{island}": value},
                },
                "spec": {
                    "slices": 1,
                    "placementPolicy": {
                        "type": "ExclusiveTopology",
                        "topology": node_label(island),
                    },
                    "roles": [_role(c, levels) for c in clusters],
                },
            }
        )
    return out


# -- SGLang's protocol through Envoy ------------------------------------------------------------


def sglang_protocol(runtime: Runtime) -> bool:
    pd = runtime.pd
    return pd is not None and pd.protocol == "sglang"


def prefill_mirror_policies(runtime: Runtime) -> Json:
    """SGLang's P/D protocol: the route field that sends the request, body included (with the
    bootstrap fields the processor wrote), to the prefill endpoint the processor named in
    x-fleet-prefill-mirror, as SGLang's router sends both halves at once. The mirror's answer
    is dropped (the router uses the decode answer too); it is sent once per request, not per
    retry; no header, no mirror. The host is kept as is (no "-shadow" suffix)."""
    if not sglang_protocol(runtime):
        return {}
    return {
        "request_mirror_policies": [
            {"cluster_header": PREFILL_MIRROR_HEADER, "disable_shadow_host_suffix_append": True}
        ]
    }


def prefill_mirror_targets(runtime: Runtime) -> list[tuple[str, str, str]]:
    """(Envoy cluster name, endpoint, health path) per prefill endpoint: one cluster each, so
    the mirror reaches exactly the host named in bootstrap_host (SGLang's protocol only)."""
    pd = runtime.pd
    if pd is None or not sglang_protocol(runtime):
        return []
    health = {c.name: c.health_path for c in runtime.clusters}
    seen = {ep.address: ep.cluster for pool in pd.pools.values() for ep in pool}
    return [
        (prefill_mirror_cluster(address), address, health.get(cluster, "/health"))
        for address, cluster in sorted(seen.items())
    ]
