"""Responses API turns chained by ``previous_response_id``: which session they belong to.

A client of ``/v1/responses`` that chains turns with ``previous_response_id`` (and no
``conversation``) sends only the new input: no prefix key can see the conversation in it. The
engine that produced the previous response holds it (vLLM keeps stored responses in the
serving process: another engine answers 404 "Response with id ... not found"), and its KV
cache holds the conversation's prefix. So the turn must follow the previous response's session.

The shell learns each response's id from the response (response inspection) and keeps a
*link*: response id -> the session key of the request that produced it. A later request naming
that id takes the linked session (the same digest, so the same placement on every replica).

What a link stores, here made and read (pure):

- its **name**: 16 bytes of HMAC-SHA256(label secret, ``"resp" + id``): whoever reads Redis
  cannot test guesses of an id (an id is a capability: with it, the response can be read back);
- its **value**: the session's source and its 16-byte digest XOR the other 16 bytes of the same
  HMAC, so the unkeyed digest never sits in shared state either (each id gets its own pad).

Replicas share links only when they share the label secret (as for the affinity keys).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from extproc.core.keys import KeySource, SessionKey, session_key

# Longer ids are not ids an engine made (OpenAI's and vLLM's are ~50 characters): not followed.
MAX_ID_CHARS = 256
_SOURCES = tuple(KeySource)
_DIGEST = 16


@dataclass(frozen=True, slots=True)
class Link:
    name: bytes
    value: bytes


def _hmac(secret: bytes, response_id: str) -> bytes:
    return hmac.digest(secret, b"resp\x1f" + response_id.encode("utf-8", "surrogatepass"), "sha256")


def link_name(secret: bytes, response_id: str) -> bytes:
    return _hmac(secret, response_id)[:_DIGEST]


def make_link(secret: bytes, response_id: str, session: SessionKey) -> Link:
    mac = _hmac(secret, response_id)
    pad = mac[_DIGEST:]
    sealed = bytes(a ^ b for a, b in zip(session.digest[:_DIGEST], pad, strict=True))
    return Link(mac[:_DIGEST], bytes([_SOURCES.index(session.source)]) + sealed)


def read_link(secret: bytes, response_id: str, value: bytes) -> SessionKey | None:
    """The linked session; None for a value that is not a link (shared state is not trusted
    blindly: a foreign or truncated value is ignored, never an error)."""
    if len(value) != 1 + _DIGEST or value[0] >= len(_SOURCES):
        return None
    pad = _hmac(secret, response_id)[_DIGEST:]
    digest = bytes(a ^ b for a, b in zip(value[1:], pad, strict=True))
    return session_key(digest, _SOURCES[value[0]], secret)


def valid_response_id(value: object) -> str | None:
    """The ``previous_response_id`` worth following (a non-empty string of sane length)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    return None
