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
FLEET_HEADERS = (ROUTE_HEADER, PRIMARY_HEADER, SECONDARY_HEADER, CLASS_HEADER, SESSION_HEADER)

# Headroom above the processor's own body limit in every proxy buffer we render (Envoy's
# per-request buffer, Envoy Gateway's bufferLimit), so that the processor, not the proxy,
# answers an oversized body (with a JSON 413 in the API's format instead of a plain-text one).
# The processor's gRPC receive limit allows for it too.
BUFFER_HEADROOM = 1 << 20
