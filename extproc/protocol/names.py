"""Header names shared by the processor and the renderers (no protobuf imports here)."""

# Headers the processor sets for Envoy's routing and for upstream observability. Envoy's
# route_config lists every one of them in internal_only_headers, so a client cannot pre-set them.
ROUTE_HEADER = "x-fleet-route"
PRIMARY_HEADER = "x-fleet-primary"
SECONDARY_HEADER = "x-fleet-secondary"
CLASS_HEADER = "x-fleet-class"
SESSION_HEADER = "x-fleet-session"
FLEET_HEADERS = (ROUTE_HEADER, PRIMARY_HEADER, SECONDARY_HEADER, CLASS_HEADER, SESSION_HEADER)
