"""Session keys: precedence, the prefix key's stability and spread, bounded cost, safe labels."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import pytest

from extproc.core.api import Api, BadRequest
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import (
    KeyRules,
    KeySource,
    SessionKey,
    derive_session_key,
    prefix_material,
)
from extproc.core.placement import Rendezvous

JSON = {"content-type": "application/json"}
# These tests pin the *opening* key (prefix.key: opening), kept for comparison since the chain
# key became the default; the chain key's properties are pinned in test_chain_key.py.
RULES = KeyRules(prefix_key="opening")
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
COMPLETIONS = "/v1/completions"


def key(
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    api: Api = Api.OPENAI_CHAT,
    rules: KeyRules = RULES,
) -> SessionKey:
    result = derive_session_key(api, headers or {}, body, rules)
    assert isinstance(result, SessionKey), result
    return result


def material(body: Mapping[str, Any], api: Api, rules: KeyRules = RULES) -> bytes:
    result = prefix_material(api, body, rules)
    assert isinstance(result, bytes), result
    return result


CONVO = [{"role": "user", "content": "hello"}]


# --- precedence -----------------------------------------------------------------------------


def test_trusted_header_beats_body_fields_and_prefix() -> None:
    body = {"messages": CONVO, "prompt_cache_key": "pck", "user": "u"}
    by_header = key(body, {"x-session-id": "sess-1"})
    assert by_header.source is KeySource.HEADER
    # Only the header counts: other bodies with the same header get the same key...
    other_body = {"messages": [{"role": "user", "content": "unrelated"}], "user": "someone"}
    assert key(other_body, {"x-session-id": "sess-1"}) == by_header
    # ...and the same body with another header value gets another key.
    assert key(body, {"x-session-id": "sess-2"}).digest != by_header.digest


def test_body_fields_beat_prefix() -> None:
    with_user = key({"messages": CONVO, "user": "u-1"})
    assert with_user.source is KeySource.BODY
    assert key({"messages": [{"role": "user", "content": "other"}], "user": "u-1"}) == with_user
    assert key({"messages": CONVO}).source is KeySource.PREFIX


FIELD_VALUES: list[tuple[str, dict[str, Any]]] = [
    ("prompt_cache_key", {"prompt_cache_key": "v-pck"}),
    ("user", {"user": "v-user"}),
    ("metadata.user_id", {"metadata": {"user_id": "v-uid"}}),
    ("metadata.session_id", {"metadata": {"session_id": "v-sid"}}),
]


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": CONVO}
    for part in parts:
        for name, value in part.items():
            if isinstance(value, dict):
                out.setdefault(name, {}).update(value)
            else:
                out[name] = value
    return out


@pytest.mark.parametrize(
    "position",
    range(len(FIELD_VALUES)),
    ids=[
        "prompt_cache_key-beats-the-rest",
        "user-beats-metadata",
        "metadata.user_id-beats-metadata.session_id",
        "metadata.session_id-alone",
    ],
)
def test_body_field_order(position: int) -> None:
    """A field decides the key whenever it and every later field are present."""
    all_from_here = _merge([fields for _, fields in FIELD_VALUES[position:]])
    only_this = _merge([FIELD_VALUES[position][1]])
    assert key(all_from_here) == key(only_this)
    assert key(all_from_here).source is KeySource.BODY
    if position + 1 < len(FIELD_VALUES):
        only_next = _merge([FIELD_VALUES[position + 1][1]])
        assert key(all_from_here) != key(only_next)


@pytest.mark.parametrize(
    "value",
    ["", 123, None, ["u"], {"id": "u"}],
    ids=["empty-string", "number", "null", "list", "object"],
)
def test_body_field_that_is_not_a_nonempty_string_is_skipped(value: object) -> None:
    assert key({"messages": CONVO, "user": value, "metadata": {"user_id": "m"}}) == key(
        {"messages": CONVO, "metadata": {"user_id": "m"}}
    )


def test_metadata_that_is_not_an_object_is_skipped() -> None:
    assert key({"messages": CONVO, "metadata": "user_id"}).source is KeySource.PREFIX


def test_empty_header_falls_through_to_the_body() -> None:
    assert key({"messages": CONVO, "user": "u"}, {"x-session-id": ""}).source is KeySource.BODY


def test_no_configured_header_means_no_header_key() -> None:
    rules = KeyRules(header=None, prefix_key="opening")
    got = key({"messages": CONVO}, {"x-session-id": "sess"}, rules=rules)
    assert got.source is KeySource.PREFIX


def test_configured_body_fields_replace_the_defaults() -> None:
    rules = KeyRules(body_fields=(("metadata", "tenant"),), prefix_key="opening")
    body = {"messages": CONVO, "user": "u", "metadata": {"tenant": "t-1"}}
    assert key(body, rules=rules) == key(
        {"messages": [], "metadata": {"tenant": "t-1"}}, rules=rules
    )


# --- prefix key: stable across turns --------------------------------------------------------


def _chat_turns(rng: random.Random, turns: int) -> list[tuple[Api, dict[str, Any]]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding assistant."}]
    out = []
    for k in range(turns):
        msgs.append({"role": "user", "content": f"question {k} {rng.random()}"})
        out.append((Api.OPENAI_CHAT, {"model": "m", "messages": list(msgs)}))
        msgs.append({"role": "assistant", "content": f"answer {k} {rng.random()}"})
    return out


def _anthropic_turns(rng: random.Random, turns: int) -> list[tuple[Api, dict[str, Any]]]:
    msgs: list[dict[str, Any]] = []
    out = []
    for k in range(turns):
        msgs.append(
            {"role": "user", "content": [{"type": "text", "text": f"question {k} {rng.random()}"}]}
        )
        body = {
            "model": "m",
            "system": [{"type": "text", "text": "You are a coding assistant."}],
            "messages": list(msgs),
        }
        out.append((Api.ANTHROPIC_MESSAGES, body))
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {k}"}]})
    return out


def _responses_turns(rng: random.Random, turns: int) -> list[tuple[Api, dict[str, Any]]]:
    items: list[dict[str, Any]] = []
    out = []
    for k in range(turns):
        items.append(
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": f"question {k} {rng.random()}"}],
            }
        )
        body = {"model": "m", "instructions": "You are a coding assistant.", "input": list(items)}
        out.append((Api.OPENAI_RESPONSES, body))
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer {k}"}],
            }
        )
        items.append({"type": "function_call_output", "call_id": f"c{k}", "output": "ok"})
    return out


TURNS: list[Callable[[random.Random, int], list[tuple[Api, dict[str, Any]]]]] = [
    _chat_turns,
    _anthropic_turns,
    _responses_turns,
]


@pytest.mark.parametrize("turns_of", TURNS, ids=["chat", "anthropic", "responses"])
def test_prefix_key_is_stable_across_turns(
    turns_of: Callable[[random.Random, int], list[tuple[Api, dict[str, Any]]]],
) -> None:
    rng = random.Random(7)
    convo_a = turns_of(rng, 6)
    convo_b = turns_of(rng, 6)
    keys_a = {key(body, api=api).digest for api, body in convo_a}
    keys_b = {key(body, api=api).digest for api, body in convo_b}
    assert len(keys_a) == 1, "turn k+1 extends turn k: every turn keeps the first turn's key"
    assert len(keys_b) == 1
    assert keys_a != keys_b, "two conversations with different openings must not share a key"


# --- prefix key: spread and sharing ----------------------------------------------------------


def test_shared_system_prompt_does_not_collapse_the_fleet() -> None:
    """1,000 conversations behind one long identical system prompt spread over 8 clusters."""
    rng = random.Random(20240601)
    system = "You are a helpful assistant. " * 2000  # ~58 KB, inside system_chars
    words = ["alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel", "india"]
    placer = Rendezvous.of([(f"c{i}", 1.0) for i in range(8)])
    digests = set()
    load: Counter[str] = Counter()
    for _ in range(1000):
        first = " ".join(rng.choice(words) for _ in range(12))
        body = {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": first},
            ]
        }
        k = key(body)
        digests.add(k.digest)
        load[placer.top2(k.point).primary] += 1
    assert len(digests) == 1000
    assert len(load) == 8
    assert max(load.values()) / (1000 / 8) <= 1.3


@pytest.mark.parametrize(
    ("api", "wrap"),
    [
        (Api.OPENAI_CHAT, lambda text: {"messages": [{"role": "user", "content": text}]}),
        (
            Api.ANTHROPIC_MESSAGES,
            lambda text: {
                "system": "Answer from the document.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            },
        ),
        (Api.OPENAI_RESPONSES, lambda text: {"input": text}),
        (Api.OPENAI_COMPLETIONS, lambda text: {"prompt": text}),
    ],
    ids=["chat", "anthropic", "responses", "completions"],
)
def test_a_shared_long_document_at_the_start_shares_the_key(
    api: Api, wrap: Callable[[str], dict[str, Any]]
) -> None:
    cap = RULES.prompt_chars if api is Api.OPENAI_COMPLETIONS else RULES.first_message_chars
    rng = random.Random(3)
    long_doc = "".join(rng.choice("abcdefghij ") for _ in range(cap + 500))
    short_doc = long_doc[: cap // 2]
    q1, q2 = "\n\nQ: what is the summary?", "\n\nQ: list the dates."
    # Past the cap only the document is hashed: different questions, one key (one KV cache).
    assert key(wrap(long_doc + q1), api=api) == key(wrap(long_doc + q2), api=api)
    # Within the cap the question is part of the opening: different questions, different keys.
    assert key(wrap(short_doc + q1), api=api) != key(wrap(short_doc + q2), api=api)


# --- bounded cost ----------------------------------------------------------------------------

EIGHT_MIB = 8 << 20
HUNDRED_KIB = 100 << 10


def _big_texts() -> tuple[str, str]:
    """Two 8 MiB texts that agree on their first 100 KiB and differ everywhere after."""
    rng = random.Random(11)
    head = "".join(rng.choice("abcdefghijklmnop ") for _ in range(HUNDRED_KIB))
    tail_a = "A" * (EIGHT_MIB - HUNDRED_KIB)
    tail_b = "B" * (EIGHT_MIB - HUNDRED_KIB)
    return head + tail_a, head + tail_b


BIG_SHAPES: list[tuple[Api, Callable[[str], dict[str, Any]]]] = [
    (
        Api.OPENAI_CHAT,
        lambda t: {
            "messages": [{"role": "system", "content": t}, {"role": "user", "content": "q"}]
        },
    ),
    (Api.OPENAI_CHAT, lambda t: {"messages": [{"role": "user", "content": t}]}),
    (
        Api.OPENAI_CHAT,
        # Many small typed parts: the cap must count characters across parts.
        lambda t: {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": t[i : i + 4096]} for i in range(0, len(t), 4096)
                    ],
                }
            ]
        },
    ),
    (
        Api.ANTHROPIC_MESSAGES,
        lambda t: {
            "system": [{"type": "text", "text": t[i : i + 65536]} for i in range(0, len(t), 65536)],
            "messages": [{"role": "user", "content": "q"}],
        },
    ),
    (Api.OPENAI_RESPONSES, lambda t: {"instructions": t, "input": "q"}),
    (Api.OPENAI_COMPLETIONS, lambda t: {"prompt": t}),
]


@pytest.mark.parametrize(
    ("api", "wrap"),
    BIG_SHAPES,
    ids=[
        "chat-8MiB-system",
        "chat-8MiB-first-message",
        "chat-8MiB-in-2048-typed-parts",
        "anthropic-8MiB-system-blocks",
        "responses-8MiB-instructions",
        "completions-8MiB-prompt",
    ],
)
def test_prefix_key_hashes_a_bounded_amount(
    api: Api, wrap: Callable[[str], dict[str, Any]]
) -> None:
    text_a, text_b = _big_texts()
    body_a, body_b = wrap(text_a), wrap(text_b)
    # Only what lies past the first 100 KiB differs, so equal keys show nothing past it is read.
    assert key(body_a, api=api) == key(body_b, api=api)
    # And what is hashed is bounded by the rules, not by the body: each character is at most 4
    # bytes of UTF-8; typed parts add at most one separator per character kept.
    cap_chars = RULES.system_chars + max(RULES.first_message_chars, RULES.prompt_chars)
    assert len(material(body_a, api)) <= 2 * 4 * cap_chars + 64


def test_a_multi_mib_body_parses_to_the_same_prefix_key() -> None:
    """Through the whole parser, as the processor calls it, with real 8 MiB JSON bodies."""
    text_a, text_b = _big_texts()
    raw_a = orjson.dumps({"messages": [{"role": "user", "content": text_a}]})
    raw_b = orjson.dumps({"messages": [{"role": "user", "content": text_b}]})
    assert len(raw_a) > EIGHT_MIB
    assert raw_a != raw_b
    fa = parse_request(CHAT, JSON, raw_a, RULES, ParseLimits())
    fb = parse_request(CHAT, JSON, raw_b, RULES, ParseLimits())
    assert isinstance(fa, RequestFacts)
    assert isinstance(fb, RequestFacts)
    assert fa.session == fb.session


# --- labels -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "raw"),
    [
        ({"x-session-id": "alice-session-0001"}, {"messages": CONVO}, "alice-session-0001"),
        ({}, {"messages": CONVO, "user": "bob@example.com"}, "bob@example.com"),
        ({}, {"messages": CONVO, "metadata": {"user_id": "0123456789abcdef"}}, "0123456789abcdef"),
        (
            {},
            {"messages": [{"role": "user", "content": "deadbeefcafebabe my secret"}]},
            "deadbeefcafebabe",
        ),
    ],
    ids=["header", "body-user", "metadata-user-id-that-looks-like-hex", "prefix-text"],
)
def test_label_never_contains_the_raw_key(
    headers: dict[str, str], body: dict[str, Any], raw: str
) -> None:
    k = key(body, headers)
    assert len(k.label) == 16
    int(k.label, 16)  # hex only
    assert raw not in k.label
    assert raw.encode().hex()[:16] != k.label
    assert k.label not in raw


def test_source_kinds_are_namespaced() -> None:
    """The same string as header and as body field are different keys: sources never alias."""
    header = key({"messages": CONVO}, {"x-session-id": "same"})
    body = key({"messages": CONVO, "user": "same"})
    assert header.digest != body.digest


def test_bad_shape_is_reported_not_raised() -> None:
    result = derive_session_key(Api.OPENAI_CHAT, {}, {"messages": "hi"}, RULES)
    assert isinstance(result, BadRequest)
    assert result.param == "messages"


# --- non-text parts -------------------------------------------------------------------------


def _image_b64(rng: random.Random, size: int = 30_000) -> str:
    # Real images share long identical headers (PNG signature, IHDR, colour profile): model that
    # with a 4 KiB common head so the test fails for a key that reads only the start.
    head = "iVBORw0KGgoAAAANSUhEUgAA" + "A" * 4096
    body = "".join(
        rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/") for _ in range(size)
    )
    return head + body


IMAGE_SHAPES: list[tuple[Api, Callable[[str], dict[str, Any]]]] = [
    (
        Api.OPENAI_CHAT,
        lambda img: {
            "messages": [
                {"role": "system", "content": "You describe images."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + img}},
                        {"type": "text", "text": "Describe this image."},
                    ],
                },
            ]
        },
    ),
    (
        Api.ANTHROPIC_MESSAGES,
        lambda img: {
            "system": "You describe images.",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": img},
                        },
                        {"type": "text", "text": "Describe this image."},
                    ],
                }
            ],
        },
    ),
    (
        Api.OPENAI_RESPONSES,
        lambda img: {
            "instructions": "You describe images.",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": "data:image/png;base64," + img},
                        {"type": "input_text", "text": "Describe this image."},
                    ],
                }
            ],
        },
    ),
]


@pytest.mark.parametrize(
    ("api", "wrap"),
    IMAGE_SHAPES,
    ids=["chat-image-url", "anthropic-image-block", "responses-input-image"],
)
def test_same_question_about_different_images_gets_different_keys(
    api: Api, wrap: Callable[[str], dict[str, Any]]
) -> None:
    rng = random.Random(5)
    images = [_image_b64(rng) for _ in range(20)]
    keys = [key(wrap(img), api=api).digest for img in images]
    assert len(set(keys)) == len(images)
    # The same image asked again (the next turn, a retry) keeps its key.
    assert key(wrap(images[0]), api=api).digest == keys[0]


@pytest.mark.parametrize(("api", "wrap"), IMAGE_SHAPES, ids=["chat", "anthropic", "responses"])
def test_an_8_mib_image_is_fingerprinted_in_bounded_space(
    api: Api, wrap: Callable[[str], dict[str, Any]]
) -> None:
    huge = _image_b64(random.Random(9), 1000) * (EIGHT_MIB // 5096)
    assert len(huge) > 8_000_000
    cap_chars = RULES.system_chars + RULES.first_message_chars
    assert len(material(wrap(huge), api)) <= 2 * 4 * cap_chars + 64


def test_part_key_order_does_not_change_the_key() -> None:
    img = _image_b64(random.Random(1))
    a = {"type": "image_url", "image_url": {"url": img, "detail": "high"}}
    b = {"image_url": {"detail": "high", "url": img}, "type": "image_url"}
    assert key({"messages": [{"role": "user", "content": [a]}]}) == key(
        {"messages": [{"role": "user", "content": [b]}]}
    )


def test_responses_conversation_keys_the_session_across_chained_turns() -> None:
    """Turns chained by previous_response_id carry only their new input; the conversation id
    is what they share, as a string or as {"id": ...}."""
    rules = KeyRules(prefix_key="opening")
    headers = {"content-type": "application/json"}
    keys = set()
    for turn, conversation in enumerate(["conv_1", {"id": "conv_1"}]):
        body = {"model": "m", "input": f"turn {turn}", "conversation": conversation}
        key = derive_session_key(Api.OPENAI_RESPONSES, headers, body, rules)
        assert not isinstance(key, BadRequest)
        assert key.source is KeySource.BODY
        keys.add(key.digest)
    assert len(keys) == 1
