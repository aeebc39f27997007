"""Names and constants shared by the processor, the config checks and the renderers.

A neutral home: protocol/, config/ and render/ all import it, and it imports nothing, so none of
them has to import another to agree on a header name or a buffer size.
"""

# Every header the processor sets starts with this; config refuses client-side session/tier
# headers in this namespace (Envoy strips them from client requests, see internal_only_headers).
FLEET_HEADER_PREFIX = "x-fleet-"

# Headers the processor sets for Envoy's routing and for upstream observability. Envoy's
# route_config lists every one of them in internal_only_headers, so a client cannot pre-set them.
ROUTE_HEADER = "x-fleet-route"
PRIMARY_HEADER = "x-fleet-primary"
SECONDARY_HEADER = "x-fleet-secondary"
CLASS_HEADER = "x-fleet-class"
SESSION_HEADER = "x-fleet-session"
# What Envoy's consistent hash inside each cluster reads to keep a session on one engine (route
# mode, engines.affinity: sticky); equal on every processor replica (core/endpoints.engine_key).
ENGINE_KEY_HEADER = "x-fleet-engine-key"
# The Envoy cluster of every endpoint (render/envoy.py FALLBACK_CLUSTER): fail-open's, and in
# route mode where a LoRA adapter's request goes when the processor names its engines.
EVERY_ENDPOINT_CLUSTER = "all_clusters"
FLEET_HEADERS = (
    ROUTE_HEADER,
    PRIMARY_HEADER,
    SECONDARY_HEADER,
    CLASS_HEADER,
    SESSION_HEADER,
    ENGINE_KEY_HEADER,
)

# Disaggregated prefill/decode: llm-d's request header naming the prefill endpoint (host:port)
# for the routing sidecar in the decode pod (llm-d-inference-scheduler PrefillEndpointHeader).
# The sidecar dials whatever it names, so a client must never set it: it is internal-only too.
PREFILLER_HEADER = "x-prefiller-host-port"
# SGLang's protocol (disaggregation.protocol "sglang"): the Envoy cluster (one per prefill
# endpoint) the route's request mirror sends the same body to. Internal-only as well.
PREFILL_MIRROR_HEADER = "x-fleet-prefill-mirror"
PD_HEADERS = (PREFILLER_HEADER, PREFILL_MIRROR_HEADER)
# Tracing: the processor's decision span context for the engine, beside traceparent (which a
# tracing Envoy's router overwrites with its own); moved back by the rendered upstream filter.
TRACEPARENT_HEADER = "x-fleet-traceparent"


def prefill_mirror_cluster(address: str) -> str:
    """The Envoy cluster holding only prefill endpoint ``address`` (SGLang's protocol): the
    bootstrap fields name that host, so the mirror must reach exactly it."""
    return "prefill-mirror-" + "".join(c if c.isalnum() or c == "." else "-" for c in address)


# Headroom above the processor's own body limit in every proxy buffer we render (Envoy's
# per-request buffer, Envoy Gateway's bufferLimit), so that the processor, not the proxy,
# answers an oversized body (with a JSON 413 in the API's format instead of a plain-text one).
# The processor's gRPC receive limit allows for it too.
BUFFER_HEADROOM = 1 << 20

# Which cluster served a request, from Envoy itself (no engine header needed). Every endpoint
# of an inference cluster (and of the fallback cluster) carries its cluster's name in this
# metadata namespace; the ext_proc filter asks for the serving host's metadata and address as
# response attributes. Measured on Envoy 1.40: with a (primary, secondary) aggregate cluster
# ``xds.cluster_name`` names the aggregate ("c1__c2"), not the member that served, so it cannot
# tell a failover; the host's metadata and ``upstream.address`` can.
SERVED_METADATA_NAMESPACE = "fleet-extproc"
SERVED_METADATA_KEY = "cluster"
HOST_METADATA_ATTRIBUTE = "xds.upstream_host_metadata"
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"
SERVED_ATTRIBUTES = (HOST_METADATA_ATTRIBUTE, UPSTREAM_ADDRESS_ATTRIBUTE)
# The key under which Envoy sends the filter's attributes in ProcessingRequest.attributes.
EXT_PROC_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"

# Headroom over a class's max_wait_s for the message timer the processor re-arms while a request
# waits for budget (protocol/responses.py sends it, render/envoy.py bounds it): the decision that
# ends the wait still makes a Redis round trip or two.
WAIT_TIMER_HEADROOM_S = 1.0

# The response code details of every answer the processor gives itself (an ImmediateResponse;
# extproc/protocol/responses.immediate). Envoy's local reply mapper rewrites, as a JSON error,
# every other answer Envoy writes itself (extproc/render/local_reply.py): this is how it tells
# the two apart.
IMMEDIATE_DETAILS_PREFIX = "fleet_"
