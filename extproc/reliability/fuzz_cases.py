"""Hypothesis strategies for hostile inference requests, and the oracle that judges answers.

A :class:`Case` is one HTTP exchange as Envoy would hand it to the processor (or as a client
sends it to Envoy): path, method, raw header pairs, body bytes, how the body is split, request
trailers, and — for routed requests — the upstream's response headers and body (the processor
reads load reports and usage from those).

Strategies start from a valid request of one of the four APIs and apply mutations:

- structure: every field the parser reads set to a value of the wrong type (or removed), deep
  nesting, duplicate keys, huge and odd number literals, giant strings;
- encoding: invalid UTF-8 inside strings, lone surrogates (escaped and raw), a UTF-8 BOM,
  truncation, gzip / br content-encoding, multipart bodies;
- transport: chunked uploads with trailers (the body arrives with end_of_stream=false), bodies
  split over several messages, empty bodies;
- headers: floods, oversized values, duplicate names, and hostile values in the headers the
  session-key and tier logic read.

The oracle (:func:`judge_answer`) accepts exactly two answers to an inference POST: a routed
request (routing headers naming a configured cluster and class) or an immediate JSON error in
the API's own error format. Anything else — no decision, a non-JSON error, a wrong format —
is a defect.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
ANTHROPIC_PATHS = ("/v1/messages",)
SESSION_HEADER = "x-session-id"
TIER_HEADER = "x-tenant-tier"

# Every body field the parser reads, per API (session fields, prefix material, output cap).
COMMON_FIELDS = (
    "model",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "prompt_cache_key",
    "conversation",
    "user",
    "metadata",
)
API_FIELDS = {
    "chat": ("messages",),
    "messages": ("messages", "system"),
    "completions": ("prompt",),
    "responses": ("input", "instructions"),
}


@dataclass(frozen=True)
class Raw:
    """A literal JSON token written as-is (odd numbers, invalid literals)."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """A JSON object written with its keys in order, duplicates kept."""

    items: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Case:
    api: str  # key of PATHS, or "other" for a non-inference path
    path: str
    method: str
    client_headers: tuple[tuple[str, bytes], ...]
    body: bytes
    # Headers the body's encoding needs (content-encoding, a multipart content-type).
    body_headers: tuple[tuple[str, bytes], ...] = ()
    chunks: int = 1  # >1: the body arrives in several messages
    trailers: tuple[tuple[str, bytes], ...] = ()
    response_headers: tuple[tuple[str, bytes], ...] = ()
    response_body: bytes = b""
    body_mutations: tuple[str, ...] = ()
    header_mutations: tuple[str, ...] = ()
    transfer_mutations: tuple[str, ...] = ()

    @property
    def inference(self) -> bool:
        return self.api != "other" and self.method == "POST"

    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]:
        override = {k for k, _v in self.body_headers}
        kept = tuple((k, v) for k, v in self.client_headers if k not in override)
        return kept + self.body_headers

    @property
    def mutations(self) -> tuple[str, ...]:
        return self.body_mutations + self.header_mutations + self.transfer_mutations


# ----- JSON writing with the freedoms orjson does not give -----------------------------------


def emit(value: Any, ascii_only: bool = False) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        inner = ",".join(f"{emit(k, ascii_only)}:{emit(v, ascii_only)}" for k, v in value.items)
        return "{" + inner + "}"
    if isinstance(value, dict):
        inner = ",".join(f"{emit(k, ascii_only)}:{emit(v, ascii_only)}" for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(emit(v, ascii_only) for v in value) + "]"
    if isinstance(value, float) and value != value:  # NaN: json.dumps would write NaN
        return "NaN"
    return json.dumps(value, ensure_ascii=ascii_only)


def encode(value: Any, ascii_only: bool = False) -> bytes:
    # surrogatepass: a lone surrogate in a Python str becomes the (invalid UTF-8) CESU bytes a
    # buggy client would send.
    return emit(value, ascii_only).encode("utf-8", "surrogatepass")


# ----- value strategies ---------------------------------------------------------------------

ODD_NUMBERS = (
    "1e999",
    "-1e999",
    "1e-999",
    "-0",
    "0e0",
    "123456789012345678901234567890123456789",
    "-9223372036854775809",
    "18446744073709551616",
    "9223372036854775807",
    "1.7976931348623157e308",
    "5e-324",
    "NaN",
    "Infinity",
    "-Infinity",
    "0x10",
    "01",
    "1.",
    ".5",
    "+1",
)

texts = st.text(max_size=40) | st.sampled_from(["", " ", "\x00", "\u2028", "\ufeff", "é" * 10])
surrogates = st.sampled_from(["\ud800", "\udfff", "a\ud83dz", "\udc00\ud800"])
scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
    st.sampled_from(ODD_NUMBERS).map(Raw),
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def nested(draw: st.DrawFn) -> Raw:
    """A value buried in arrays/objects, up to far past any parser's recursion limit (written
    as text: building it as Python objects would hit our own recursion limit first)."""
    depth = draw(st.sampled_from([10, 100, 500, 1023, 1024, 1025, 3000, 100_000]))
    inner = emit(draw(scalars))
    if draw(st.booleans()):
        return Raw('{"a":' * depth + inner + "}" * depth)
    return Raw("[" * depth + inner + "]" * depth)


def giant_text(draw: st.DrawFn) -> str:
    size = draw(st.sampled_from([64 << 10, 64 << 10, 1 << 20, 3 << 20]))
    return draw(st.sampled_from("ab☃")) * size


# ----- valid requests -----------------------------------------------------------------------

roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "SYSTEM", "x"])
content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries(
            {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": texts})}
        ),
        json_values,
    ),
    max_size=3,
)
contents = texts | content_parts
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=4)


@st.composite
def valid_doc(draw: st.DrawFn, api: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": draw(st.sampled_from(["m", "sim", "gpt-x", "claude"]))}
    if api == "chat":
        doc["messages"] = draw(messages)
    elif api == "messages":
        doc["messages"] = draw(messages)
        doc["max_tokens"] = draw(st.integers(1, 4096))
        if draw(st.booleans()):
            doc["system"] = draw(texts | st.lists(st.fixed_dictionaries({"text": texts})))
    elif api == "completions":
        doc["prompt"] = draw(
            texts
            | st.lists(texts, max_size=3)
            | st.lists(st.integers(0, 100_000), max_size=8)
            | st.lists(st.lists(st.integers(0, 100_000), max_size=4), max_size=3)
        )
    else:
        doc["input"] = draw(texts | messages)
        if draw(st.booleans()):
            doc["instructions"] = draw(texts)
    optional = {
        "stream": st.booleans(),
        "max_tokens": st.integers(0, 100_000),
        "prompt_cache_key": texts,
        "user": texts,
        "metadata": st.fixed_dictionaries({"user_id": texts, "session_id": texts}),
        "conversation": texts | st.fixed_dictionaries({"id": texts}),
    }
    for name, strategy in optional.items():
        if draw(st.integers(0, 3)) == 0:
            doc[name] = draw(strategy)
    return doc


# ----- mutations ----------------------------------------------------------------------------


@st.composite
def mutated_body(draw: st.DrawFn, api: str) -> tuple[bytes, list[str], dict[str, bytes]]:
    """Body bytes, the mutations applied, and headers the body needs (content-encoding...)."""
    doc: Any = draw(valid_doc(api))
    applied: list[str] = []
    extra: dict[str, bytes] = {}
    fields = COMMON_FIELDS + API_FIELDS.get(api, ())
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(
                ["wrong_type"] * 4
                + ["remove"] * 2
                + ["nested", "surrogate", "odd_number", "deep_message", "not_object"] * 2
                + ["giant_string"]
            )
        )
        applied.append(kind)
        if not isinstance(doc, dict):
            break
        name = draw(st.sampled_from(fields))
        if kind == "wrong_type":
            doc[name] = draw(json_values)
        elif kind == "remove":
            doc.pop(name, None)
        elif kind == "nested":
            doc[name] = draw(nested())
        elif kind == "giant_string":
            doc[name] = giant_text(draw)
        elif kind == "surrogate":
            doc[name] = draw(surrogates)
        elif kind == "odd_number":
            doc[name] = Raw(draw(st.sampled_from(ODD_NUMBERS)))
        elif kind == "deep_message":
            doc[name] = [{"role": draw(roles), "content": draw(nested())}]
        else:
            doc = draw(json_values)
    if isinstance(doc, dict) and draw(st.integers(0, 5)) == 0:
        # Duplicate keys: the last one wins in orjson, the first in some other parsers.
        items = list(doc.items())
        dup = draw(st.sampled_from(fields))
        items.insert(0, (dup, draw(json_values)))
        items.append((dup, draw(json_values)))
        doc = Pairs(tuple(items))
        applied.append("duplicate_keys")
    body = encode(doc, ascii_only=draw(st.booleans()))
    wire = draw(
        st.sampled_from(
            ["plain"] * 12
            + ["bom", "invalid_utf8", "truncate", "garbage", "gzip", "br", "multipart", "empty"]
        )
    )
    if wire == "plain":
        return body, applied, extra
    applied.append(wire)
    if wire == "bom":
        body = b"\xef\xbb\xbf" + body
    elif wire == "invalid_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
        at = body.find(b'"', 1)
        at = at + 1 if at > 0 else len(body) // 2
        body = body[:at] + bad + body[at:]
    elif wire == "truncate":
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    elif wire == "garbage":
        body = body + draw(st.binary(min_size=1, max_size=16))
    elif wire == "gzip":
        body = gzip.compress(body, mtime=0)  # no clock in the bytes: a seed gives one pool
        extra["content-encoding"] = b"gzip"
    elif wire == "br":
        body = _brotli(body)
        extra["content-encoding"] = b"br"
    elif wire == "multipart":
        boundary = b"fuzzboundary"
        body = (
            b"--" + boundary + b'\r\ncontent-disposition: form-data; name="json"\r\n'
            b"content-type: application/json\r\n\r\n" + body + b"\r\n--" + boundary + b"--\r\n"
        )
        extra["content-type"] = b"multipart/form-data; boundary=" + boundary
    else:
        body = b""
    return body, applied, extra


def _brotli(data: bytes) -> bytes:
    try:
        import brotli  # type: ignore[import-not-found]
    except ImportError:
        # Not installed: what matters to the gateway is a body it cannot read as JSON.
        return b"\x8b\x02\x80" + data[::-1]
    out: bytes = brotli.compress(data)
    return out


header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=24)
header_bytes = st.binary(max_size=64) | st.text(max_size=64).map(
    lambda s: s.encode("utf-8", "surrogatepass")
)
content_types = st.sampled_from(
    [
        b"application/json",
        b"application/json; charset=utf-8",
        b"APPLICATION/JSON",
        b"application/vnd.api+json",
        b"text/plain",
        b"application/x-www-form-urlencoded",
        b"",
        b"application/json\x00",
        b"application/json;;;",
    ]
)
hostile_values = st.one_of(
    header_bytes,
    st.sampled_from([b"", b" ", b"\xff\xfe", b"\xed\xa0\x80", b"\x00", "é".encode() * 100]),
    st.integers(1, 256 << 10).map(lambda n: b"s" * n),
)


@st.composite
def mutated_headers(draw: st.DrawFn, api: str) -> tuple[list[tuple[str, bytes]], list[str]]:
    applied: list[str] = []
    pairs: list[tuple[str, bytes]] = []
    ct_mutated = draw(st.integers(0, 7)) == 0
    pairs.append(
        ("content-type", draw(content_types) if ct_mutated else b"application/json"),
    )
    if ct_mutated:
        applied.append("content_type")
    if api == "messages":
        pairs.append(("anthropic-version", b"2023-06-01"))
    if draw(st.booleans()):
        pairs.append((SESSION_HEADER, draw(hostile_values)))
        applied.append("session_header")
    if draw(st.integers(0, 2)) == 0:
        pairs.append((TIER_HEADER, draw(hostile_values | st.sampled_from([b"gold", b"free"]))))
        applied.append("tier_header")
    if draw(st.integers(0, 4)) == 0:
        pairs.append(("x-request-id", draw(hostile_values)))
    if draw(st.integers(0, 8)) == 0:
        count = draw(st.sampled_from([50, 200, 1000]))
        pairs.extend((f"x-flood-{i}", b"v" * draw(st.integers(0, 64))) for i in range(count))
        applied.append("header_flood")
    if draw(st.integers(0, 8)) == 0:
        name = draw(st.sampled_from([SESSION_HEADER, TIER_HEADER, "content-type", "x-other"]))
        pairs.append((name, draw(hostile_values)))
        applied.append("duplicate_header")
    if draw(st.integers(0, 10)) == 0:
        pairs.append((draw(header_names), b"o" * draw(st.sampled_from([8 << 10, 64 << 10]))))
        applied.append("oversized_header")
    return pairs, applied


load_values = st.one_of(
    st.sampled_from(
        [
            b"kv=0.5,queue=1,inflight=3",
            b"kv=nan,queue=-1,inflight=1e999",
            b"kv=,queue=,inflight=",
            b"TEXT cpu_utilization=0.5, named_metrics.kv_cache=2.0",
            b"TEXT cpu_utilization=inf",
            b"JSON {}",
        ]
    ),
    header_bytes,
)


@st.composite
def response_side(draw: st.DrawFn, api: str) -> tuple[tuple[tuple[str, bytes], ...], bytes]:
    """What an upstream (or a hostile one) answers: load headers and a usage-bearing body."""
    headers = [(":status", draw(st.sampled_from([b"200", b"429", b"503", b"abc"])))]
    stream = draw(st.booleans())
    headers.append(
        ("content-type", b"text/event-stream" if stream else b"application/json"),
    )
    for name in ("x-fleet-load", "endpoint-load-metrics", "x-served-by"):
        if draw(st.booleans()):
            headers.append((name, draw(load_values | st.sampled_from([b"c1", b"c9"]))))
    usage = draw(json_values | st.fixed_dictionaries({"prompt_tokens": json_values}))
    if stream:
        body = b"data: " + encode({"usage": usage}) + b"\n\ndata: [DONE]\n\n"
        if draw(st.booleans()):
            body = draw(st.binary(max_size=64)) + body
    else:
        body = encode({"usage": usage}) if draw(st.booleans()) else draw(st.binary(max_size=64))
    return tuple(headers), body


@st.composite
def cases(draw: st.DrawFn) -> Case:
    api = draw(st.sampled_from([*PATHS, *PATHS, *PATHS, "other"]))
    if api == "other":
        path = draw(st.sampled_from(["/v1/models", "/", "/v1/chat", "/health", "/v1/embeddings"]))
    else:
        path = PATHS[api] + draw(st.sampled_from(["", "", "", "?x=1", "/", "?stream=true"]))
    method = "POST" if draw(st.integers(0, 15)) else draw(st.sampled_from(["GET", "PUT"]))
    body, applied, extra = draw(mutated_body(api if api != "other" else "chat"))
    pairs, header_applied = draw(mutated_headers(api))
    chunks = 1
    trailers: tuple[tuple[str, bytes], ...] = ()
    transfer = draw(st.integers(0, 11))
    transfer_applied: tuple[str, ...] = ()
    if transfer == 0:
        chunks = draw(st.integers(2, 4))
        transfer_applied = ("split_body",)
    elif transfer == 1:
        trailers = (("x-checksum", draw(header_bytes)),)
        transfer_applied = ("trailers",)
    resp_headers, resp_body = draw(response_side(api))
    return Case(
        api=api,
        path=path,
        method=method,
        client_headers=tuple(pairs),
        body=body,
        body_headers=tuple(extra.items()),
        chunks=chunks,
        trailers=trailers,
        response_headers=resp_headers,
        response_body=resp_body,
        body_mutations=tuple(applied),
        header_mutations=tuple(header_applied),
        transfer_mutations=transfer_applied,
    )


def recombine(pool: Sequence[Case], total: int, seed: int) -> Iterator[Case]:
    """``total`` cases, each the body of one pool case, the client headers of a second and the
    transfer and upstream response of a third: Hypothesis draws are costly (tens of ms per
    case on a loaded machine), combining them is not, and every part stays a Hypothesis draw.
    The first ``len(pool)`` cases are the pool itself."""
    rng = random.Random(seed)
    n = len(pool)
    for i in range(total):
        if i < n:
            yield pool[i]
            continue
        a, b, c = pool[rng.randrange(n)], pool[rng.randrange(n)], pool[rng.randrange(n)]
        yield dataclasses.replace(
            a,
            client_headers=b.client_headers,
            header_mutations=b.header_mutations,
            chunks=c.chunks,
            trailers=c.trailers,
            transfer_mutations=c.transfer_mutations,
            response_headers=c.response_headers,
            response_body=c.response_body,
        )


# ----- the oracle ---------------------------------------------------------------------------


def error_format_problem(path: str, body: bytes, content_type: str | None) -> str | None:
    """None when ``body`` is a JSON error in the API's own format, else what is wrong."""
    if content_type is not None and not content_type.startswith("application/json"):
        return f"error content-type {content_type!r}"
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"error body is not JSON: {body[:80]!r}"
    if not isinstance(doc, dict):
        return "error body is not an object"
    err = doc.get("error")
    if not isinstance(err, dict):
        return "no error object"
    anthropic = path.split("?", 1)[0].rstrip("/") in ANTHROPIC_PATHS
    if anthropic and doc.get("type") != "error":
        return "anthropic error without type=error"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return "error without string message/type"
    return None


def judge_answer(
    case: Case,
    status: int | None,
    routed_headers: Mapping[str, str] | None,
    body: bytes,
    content_type: str | None,
    clusters: Sequence[str],
    classes: Sequence[str],
) -> str | None:
    """The verdict on one inference request's decision; None when acceptable."""
    if routed_headers is not None:
        route = routed_headers.get("x-fleet-primary", "")
        klass = routed_headers.get("x-fleet-class", "")
        if route not in clusters:
            return f"routed to unknown cluster {route!r}"
        if klass not in classes:
            return f"routed with unknown class {klass!r}"
        return None
    if status is None:
        return "no decision"
    if not 400 <= status <= 599:
        return f"immediate answer with status {status}"
    return error_format_problem(case.path, body, content_type)
