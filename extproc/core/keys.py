"""Session keys: which conversation a request belongs to, as a hash.

Precedence, first match wins: a trusted header, then configured body fields, then a prefix key.

The prefix key is the *chain key* by default (``extproc.core.chains``: the shortest chain of
prompt chunks that is not common to many conversations, learnt by a sketch the shell owns).
The older *opening key* (``prefix.key: opening``) remains for comparison; it hashes the
conversation's *opening*: the system/instructions text (capped) plus the first
``first_message_chars`` characters of the first non-system message. Why that shape (and where
it fails: an opening shared outside the system role sends everything to one cluster):

- turn k+1 of a chat repeats turn k's messages and appends, so its opening is unchanged and the
  key is stable across turns;
- conversations that share only a system prompt differ in their first message, so a fleet where
  every request starts with the same system prompt does not collapse onto one cluster;
- requests that share a long document placed at the start of the first message (RAG, long
  context) share the key once the document is longer than the cap;
- the cost is bounded: at most ``system_chars + first_message_chars`` characters are hashed,
  whatever the body size.

Raw keys never leave this module: callers get a 16-byte digest (placement input) and an 8-byte
hex label (logs, the ``x-fleet-session`` header). The label is keyed: HMAC-SHA256 of the digest
under the fleet's label secret (:attr:`KeyRules.label_secret`), so a low-entropy id (an email, a
user number) cannot be recovered from a label by hashing a dictionary of guesses. Shared state
(the Redis affinity keys) names a session by 16 bytes of the same keyed hash
(:attr:`SessionKey.store_key`), so replicas share it only when they share the secret. Placement
uses the unkeyed digest, so it is the same on every replica whatever secret each one holds.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from extproc.core.api import Api, BadRequest
from extproc.core.chains import Chain, ChainParams, ChainSketch, KeyNode, chunk_chain
from extproc.core.prompt import (
    CharBudget,
    content_text,
    message_content,
    message_role,
    prompt_parts,
    prompt_segments,
)


class KeySource(StrEnum):
    HEADER = "header"
    BODY = "body"
    PREFIX = "prefix"


@dataclass(frozen=True, slots=True)
class SessionKey:
    digest: bytes  # blake2b-128 of the key material, namespaced by source kind
    source: KeySource
    # Safe to log and to send upstream: a keyed hash of the digest, never the raw key.
    label: str
    # The session's name in shared state (Redis): 16 bytes of the same keyed hash (the label is
    # its first 8), so whoever can read Redis cannot dictionary-test a low-entropy session id,
    # and an operator can find a logged label's keys by prefix.
    store_key: bytes

    @property
    def point(self) -> int:
        """64-bit position of the session on the hash space (placement input)."""
        return int.from_bytes(self.digest[:8], "big")


def _keyed(digest: bytes, secret: bytes) -> bytes:
    return hmac.digest(secret, digest, "sha256")


def session_label(digest: bytes, secret: bytes) -> str:
    """8-byte hex HMAC-SHA256 of ``digest`` under ``secret``."""
    return _keyed(digest, secret)[:8].hex()


@dataclass(frozen=True, slots=True)
class KeyRules:
    header: str | None = "x-session-id"
    # Dotted paths into the body, e.g. ("metadata", "user_id").
    body_fields: tuple[tuple[str, ...], ...] = (
        ("prompt_cache_key",),
        ("conversation",),
        ("conversation", "id"),
        ("user",),
        ("metadata", "user_id"),
        ("metadata", "session_id"),
    )
    tier_header: str | None = None
    system_chars: int = 65536
    first_message_chars: int = 1024
    # /v1/completions has no roles: its prompt's first characters play both parts.
    prompt_chars: int = 4096
    # Key of the session labels. The serving runtime always sets one (config, env, or a random
    # per-process secret: extproc.config.label_secret); the empty default is for offline tools
    # whose labels never leave the process.
    label_secret: bytes = field(default=b"", repr=False)
    # "chain": extproc.core.chains (default); "opening": system text + first message (capped).
    prefix_key: Literal["chain", "opening"] = "chain"
    chain: ChainParams = field(default_factory=ChainParams)
    # The common chains the chain key has learnt: owned by the shell (one per process, kept
    # across config reloads) and attached to the runtime it serves from. None: nothing is
    # common, the key is the first chunk's chain (tools that look at a single request).
    sketch: ChainSketch | None = field(default=None, compare=False, repr=False)
    # False: read the sketch without counting the request (explain / preview change nothing).
    learn: bool = True


def hash_key(source: KeySource, material: bytes, label_secret: bytes = b"") -> SessionKey:
    h = hashlib.blake2b(digest_size=16, person=b"fleet-" + source.value.encode()[:10])
    h.update(material)
    return session_key(h.digest(), source, label_secret)


def session_key(digest: bytes, source: KeySource, label_secret: bytes) -> SessionKey:
    """The session of ``digest``: its label and store key under ``label_secret``."""
    keyed = _keyed(digest, label_secret)
    return SessionKey(digest, source, keyed[:8].hex(), keyed[:16])


def _lookup(doc: Mapping[str, object], path: tuple[str, ...]) -> object:
    node: object = doc
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


class _Opening:
    """Accumulates the capped system text and the capped first message."""

    def __init__(self, rules: KeyRules) -> None:
        self._rules = rules
        self.system: list[str] = []
        self._system = CharBudget(rules.system_chars)
        self.first: str | None = None

    def add_system(self, content: object) -> None:
        text = content_text(content, self._system)
        if text:
            self.system.append(text)

    def set_first(self, role: str, content: object) -> None:
        if self.first is None:
            budget = CharBudget(self._rules.first_message_chars)
            self.first = role + "\x1f" + content_text(content, budget)

    def material(self) -> bytes:
        return ("\x1e".join(self.system) + "\x1d" + (self.first or "")).encode(
            "utf-8", "surrogatepass"
        )


def shape_error(api: Api, doc: Mapping[str, object]) -> BadRequest | None:
    """The API's main input field has the wrong type (or is missing).

    Checked for every request, not only those keyed by prefix: a request must not become valid
    because it happens to carry a session header or a ``user`` field.
    """
    style = api.error_style
    if api is Api.OPENAI_CHAT or api is Api.ANTHROPIC_MESSAGES:
        if not isinstance(doc.get("messages"), list):
            return BadRequest(
                400, "'messages' must be an array", "invalid_request_error", style, "messages"
            )
    elif api is Api.OPENAI_RESPONSES:
        if not isinstance(doc.get("input"), (str, list)):
            return BadRequest(
                400, "'input' must be a string or an array", "invalid_request_error", style, "input"
            )
    elif not isinstance(doc.get("prompt"), (str, list)):
        return BadRequest(
            400,
            "'prompt' must be a string or an array",
            "invalid_request_error",
            style,
            "prompt",
        )
    return None


def prefix_material(api: Api, doc: Mapping[str, object], rules: KeyRules) -> bytes | BadRequest:
    bad = shape_error(api, doc)
    if bad is not None:
        return bad
    opening = _Opening(rules)
    for kind, value in prompt_parts(api, doc):
        if kind == "system":
            opening.add_system(value)
        elif kind == "message":
            role = message_role(value)
            if role is None and not isinstance(value, Mapping):
                continue  # not a message at all
            if role == "system":
                opening.add_system(message_content(value))
                continue
            opening.set_first(role or "user", message_content(value))
            break
        elif kind == "prompt":  # completions: no roles, the prompt's start plays both parts
            if isinstance(value, list):
                ids = value[: rules.prompt_chars // 4]  # token ids: ~4 characters each
                opening.first = "ids\x1f" + ",".join(str(t) for t in ids)
            else:
                opening.first = "prompt\x1f" + str(value)[: rules.prompt_chars]
    return opening.material()


def request_chain(api: Api, doc: Mapping[str, object], params: ChainParams) -> Chain:
    segments = prompt_segments(api, doc, params.scan_bytes)
    # A completions prompt's last chunk may grow in the next turn (no message boundary).
    return chunk_chain(segments, params, last_segment_complete=api is not Api.OPENAI_COMPLETIONS)


def _chained_turn(api: Api, doc: Mapping[str, object]) -> bool:
    """A Responses turn chained by ``previous_response_id`` carries only its new input: it is
    not a conversation of its own, so it must not count toward what is common (it follows
    its previous response's session when the link is known: extproc.core.response_links)."""
    return api is Api.OPENAI_RESPONSES and doc.get("previous_response_id") is not None


def chain_key(api: Api, doc: Mapping[str, object], rules: KeyRules) -> SessionKey:
    """The chain key; with a sketch, the request also counts toward what is common."""
    sketch = rules.sketch
    chain = request_chain(api, doc, rules.chain)
    if not chain.hashes:
        return hash_key(KeySource.PREFIX, b"chain\x1f", rules.label_secret)
    node = sketch.key_node(chain) if sketch is not None else None
    if node is None:
        node = KeyNode(chain.hashes[0], 1, False)
    elif sketch is not None and rules.learn and not _chained_turn(api, doc):
        sketch.observe(chain, node)
    return hash_key(
        KeySource.PREFIX, b"chain\x1f" + node.chain.to_bytes(8, "big"), rules.label_secret
    )


def header_session_key(headers: Mapping[str, str], rules: KeyRules) -> SessionKey | None:
    """The key from the trusted session header, or None when the request carries none."""
    if not rules.header:
        return None
    value = headers.get(rules.header)
    if not value:
        return None
    return _header_key(value, rules.label_secret)


@functools.lru_cache(maxsize=4096)
def _header_key(value: str, label_secret: bytes) -> SessionKey:
    # A session sends many turns (an agent, hundreds): its key, a BLAKE2b and an HMAC, is
    # computed once per process while it is active, not on every request. Bounded: a client
    # sending a new id every time only churns the cache.
    return hash_key(KeySource.HEADER, value.encode("utf-8", "surrogatepass"), label_secret)


def derive_session_key(
    api: Api,
    headers: Mapping[str, str],
    doc: Mapping[str, object],
    rules: KeyRules,
) -> SessionKey | BadRequest:
    bad = shape_error(api, doc)
    if bad is not None:
        return bad
    by_header = header_session_key(headers, rules)
    if by_header is not None:
        return by_header
    for path in rules.body_fields:
        value_obj = _lookup(doc, path)
        if isinstance(value_obj, str) and value_obj:
            return hash_key(
                KeySource.BODY, value_obj.encode("utf-8", "surrogatepass"), rules.label_secret
            )
    if rules.prefix_key == "chain":
        return chain_key(api, doc, rules)
    material = prefix_material(api, doc, rules)
    if isinstance(material, BadRequest):
        return material
    return hash_key(KeySource.PREFIX, material, rules.label_secret)
