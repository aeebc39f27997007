"""Drop-in parts of the rendered Envoy config, for a team that already runs its own Envoy.

``extproc envoy --part filter|clusters|routes`` prints one part; envoy/parts/ holds them for
compose/fleet.yaml (tests/unit/test_envoy_parts.py checks they match this renderer and that
Envoy accepts each one embedded in a minimal host config of its own). Each part is cut out of
the complete bootstrap (extproc/render/envoy.py), so the parts and the bootstrap cannot drift:

- ``filter``: the ext_proc HTTP filter, a one-item list to put in the host's
  ``http_filters`` before ``envoy.filters.http.router``;
- ``clusters``: every cluster the filter and routes name (the inference clusters, their
  (primary, secondary) aggregates, the fallback cluster, the processor's cluster), a list to
  append to ``static_resources.clusters``;
- ``tracing`` (tracing on only): the connection manager's ``tracing`` block and the router's
  upstream filters (extproc/render/envoy_tracing.py);
- ``routes``: a ``route_config`` with the routing-header route, the fallback route, and the
  ``internal_only_headers`` that stop a client from choosing its own cluster or class. A host
  with its own virtual hosts copies the two routes into the virtual host that serves the
  inference API, and the internal_only_headers into its route_config.

What the parts cannot carry, because it belongs to the host's listener and connection
manager, is listed by :func:`host_requirements` (and in envoy/README.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from extproc.config.runtime import Runtime
from extproc.render.envoy import EnvoyOptions, render_bootstrap

Part = Literal["filter", "clusters", "routes", "tracing"]
# The parts envoy/parts/ holds (for compose/fleet.yaml, which does not trace).
PARTS: tuple[Part, ...] = ("filter", "clusters", "routes")
# With tracing on: the connection manager's ``tracing`` block and the router's upstream filters.
ALL_PARTS: tuple[Part, ...] = (*PARTS, "tracing")
ROUTER = "envoy.filters.http.router"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"

Json = dict[str, Any]


def _hcm(bootstrap: Json) -> Json:
    listener = bootstrap["static_resources"]["listeners"][0]
    typed: Json = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def render_part(runtime: Runtime, part: Part, opts: EnvoyOptions | None = None) -> Any:
    """One part, as the Envoy config value it is (a list or a mapping)."""
    opts = opts or EnvoyOptions()
    bootstrap = render_bootstrap(runtime, dataclasses.replace(opts, mode="extproc"))
    hcm = _hcm(bootstrap)
    if part == "filter":
        return [f for f in hcm["http_filters"] if f["name"] == EXT_PROC_FILTER]
    if part == "clusters":
        return bootstrap["static_resources"]["clusters"]
    if part == "routes":
        return hcm["route_config"]
    if part == "tracing":
        return tracing_part(hcm)
    raise ValueError(f"unknown part {part!r}; expected one of {', '.join(ALL_PARTS)}")


def tracing_part(hcm: Json) -> Json:
    """Tracing on (tracing.enabled): what the host's connection manager takes, ``tracing``
    (Envoy's own tracer, with tracing.endpoint), and what its router takes, the upstream filters
    that hand the processor's trace context to the engine. The collector's cluster is in the
    ``clusters`` part. Empty with tracing off."""
    out: Json = {}
    if "tracing" in hcm:
        out["http_connection_manager"] = {"tracing": hcm["tracing"]}
    (router,) = [f for f in hcm["http_filters"] if f["name"] == ROUTER]
    upstream = router["typed_config"].get("upstream_http_filters")
    if upstream:
        out["router"] = {"upstream_http_filters": upstream}
    return out


def host_requirements(runtime: Runtime) -> Json:
    """Settings of the host's listener and connection manager that the parts rely on, with
    the values the complete bootstrap uses (see the comments in extproc/render/envoy.py)."""
    bootstrap = render_bootstrap(runtime)
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = _hcm(bootstrap)
    keep = (
        "request_timeout",
        "request_headers_timeout",
        "stream_idle_timeout",
        "use_remote_address",
        "normalize_path",
        "merge_slashes",
        "path_with_escaped_slashes_action",
    )
    return {
        "listener": {
            "per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"]
        },
        "http_connection_manager": {k: hcm[k] for k in keep if k in hcm},
    }
