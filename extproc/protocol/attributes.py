"""Which cluster served a request, read from Envoy's ext_proc response attributes.

The filter asks for ``xds.upstream_host_metadata`` and ``upstream.address``
(extproc.names.SERVED_ATTRIBUTES, rendered by extproc/render/envoy.py); Envoy sends them with
the response headers message, in ``ProcessingRequest.attributes["envoy.filters.http.ext_proc"]``
(a Struct keyed by attribute name). Measured on Envoy 1.40:

- ``xds.upstream_host_metadata`` is the serving host's metadata as a protobuf text string
  (``filter_metadata { key: "fleet-extproc" value { fields { key: "cluster" ... } } }``): the
  rendered endpoints carry their cluster's name there, so it names the serving cluster with
  any address scheme (DNS names in compose and Kubernetes included);
- ``upstream.address`` is the host's resolved ``ip:port``: a fallback for endpoints rendered by
  someone else (a hand-written Envoy config), usable when fleet.yaml lists the same literal
  address under exactly one cluster;
- ``xds.cluster_name`` is the route's cluster, i.e. the (primary, secondary) aggregate, for
  both attempts of a failed-over request: useless here, so not asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Mapping

from envoy.config.core.v3 import base_pb2
from google.protobuf import text_format

from extproc.names import (
    EXT_PROC_ATTRIBUTES_KEY,
    HOST_METADATA_ATTRIBUTE,
    SERVED_METADATA_KEY,
    SERVED_METADATA_NAMESPACE,
    UPSTREAM_ADDRESS_ATTRIBUTE,
)


# One distinct text per upstream host (its metadata), so a small cache answers nearly every
# response: parsing protobuf text costs about a millisecond in Python, the lookup well under a
# microsecond.
@functools.lru_cache(maxsize=4096)
def _metadata_cluster(text: str) -> str | None:
    if SERVED_METADATA_NAMESPACE not in text:
        return None  # the common case for foreign hosts: no parse at all
    metadata = base_pb2.Metadata()
    try:
        # Typed metadata (Any) of other filters may not parse without their descriptors.
        text_format.Parse(text, metadata, allow_unknown_field=True)
    except text_format.ParseError:
        return None
    fields = metadata.filter_metadata[SERVED_METADATA_NAMESPACE].fields
    value = fields.get(SERVED_METADATA_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value or None


def served_address(attributes: Mapping[str, object]) -> str | None:
    """The serving host's ``ip:port`` (``upstream.address``), or None when Envoy did not say:
    the engine that served, in every mode (usage is counted per engine)."""
    struct = attributes.get(EXT_PROC_ATTRIBUTES_KEY)
    if struct is None:
        return None
    address = getattr(struct, "fields", {}).get(UPSTREAM_ADDRESS_ATTRIBUTE)
    if address is not None and address.WhichOneof("kind") == "string_value":
        return str(address.string_value) or None
    return None


def served_cluster(
    attributes: Mapping[str, object], known: Container[str], owners: Mapping[str, str]
) -> str | None:
    """The cluster whose host served this response, or None when Envoy did not say (attributes
    not configured, a local reply, a host of no known cluster).

    ``attributes``: ``ProcessingRequest.attributes`` (a map of Structs); ``known``: the
    configured cluster names; ``owners``: address -> cluster of the configured endpoints
    (extproc.core.failover.endpoint_owners).
    """
    struct = attributes.get(EXT_PROC_ATTRIBUTES_KEY)
    if struct is None:
        return None
    fields = getattr(struct, "fields", {})
    host = fields.get(HOST_METADATA_ATTRIBUTE)
    if host is not None and host.WhichOneof("kind") == "string_value":
        name = _metadata_cluster(host.string_value)
        if name in known:
            return name
    address = fields.get(UPSTREAM_ADDRESS_ATTRIBUTE)
    if address is not None and address.WhichOneof("kind") == "string_value":
        return owners.get(address.string_value)
    return None
