"""Let the processor see which cluster served a request, from Envoy itself.

Engines do not say which cluster they belong to (the simulated cluster's ``x-served-by`` is
our own invention), yet a failover must move load credit, usage and the budget charge to the
cluster that really served. So every rendered endpoint carries its cluster's name in its
metadata, and the ext_proc filter asks Envoy for the serving host's metadata and address as
response attributes (read by extproc/protocol/attributes.py).
"""

from __future__ import annotations

from typing import Any

from extproc.config.runtime import Runtime
from extproc.names import SERVED_ATTRIBUTES, SERVED_METADATA_KEY, SERVED_METADATA_NAMESPACE

Json = dict[str, Any]


def response_attributes(runtime: Runtime) -> Json:
    """The filter's response_attributes (none when response headers are not sent)."""
    if not runtime.response_phases:
        return {}
    return {"response_attributes": list(SERVED_ATTRIBUTES)}


def tag_endpoint(lb_endpoint: Json, cluster: str) -> Json:
    """``lb_endpoint`` with its cluster's name in the metadata the processor reads."""
    metadata = lb_endpoint.setdefault("metadata", {}).setdefault("filter_metadata", {})
    metadata[SERVED_METADATA_NAMESPACE] = {SERVED_METADATA_KEY: cluster}
    return lb_endpoint
