"""Who a request's tenant is, for fair shares and per-tenant limits inside a class.

The tenant comes from the trusted tenant header (``flow.tenant_header``: set by the edge after
authentication; the rendered Envoy configs strip any client copy), else from the fallback
(``flow.tenant_fallback``): the request's tier, its API key, or one shared tenant.

A tenant is never kept or shown by its raw value:

- ``key``, the identity in shared state (the fair queue's counters, the per-tenant limits, in
  memory and in Redis), is an unkeyed BLAKE2b digest, so every replica names a tenant alike
  whatever its label secret (as placement uses the unkeyed session digest);
- ``label``, what logs, metrics and explain show, is the digest keyed with the fleet's label
  secret (as session labels are), so it cannot be reversed by guessing names.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.core.flow import TenantFallback

API_KEY_HEADERS = ("authorization", "x-api-key")


@dataclass(frozen=True, slots=True)
class Tenant:
    key: str  # identity in shared state (unkeyed digest, hex)
    label: str  # for logs, metrics and explain (keyed digest, hex)
    source: str  # "header", "api_key", "tier" or "shared"


def _digest(source: str, value: str) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"fleet-tenant")
    h.update(source.encode())
    h.update(b"\0")
    h.update(value.encode("utf-8", "surrogatepass"))
    return h.digest()


def tenant_key(name: str) -> str:
    """The shared-state key of the tenant the tenant header names ``name`` (how fleet.yaml's
    per-tenant settings are matched)."""
    return _digest("header", name).hex()


@functools.lru_cache(maxsize=4096)
def _tenant(source: str, value: str, secret: bytes) -> Tenant:
    digest = _digest(source, value)
    return Tenant(digest.hex(), hmac.digest(secret, digest, "sha256")[:8].hex(), source)


def _api_key(headers: Mapping[str, str]) -> str | None:
    for name in API_KEY_HEADERS:
        value = headers.get(name)
        if value:
            if name == "authorization" and value[:7].lower() == "bearer ":
                value = value[7:].strip()
            return value or None
    return None


def resolve_tenant(
    headers: Mapping[str, str],
    tier: str | None,
    header: str | None,
    fallback: TenantFallback,
    secret: bytes,
) -> Tenant:
    """The tenant of a request with ``headers`` (lower-case names) and ``tier``."""
    value = headers.get(header) if header else None
    if value:
        return _tenant("header", value, secret)
    if fallback is TenantFallback.API_KEY:
        key = _api_key(headers)
        if key is not None:
            return _tenant("api_key", key, secret)
    elif fallback is TenantFallback.TIER and tier:
        return _tenant("tier", tier, secret)
    return _tenant("shared", "", secret)
