"""Response links (previous_response_id -> session): sealed under the label secret, read back
only with it; the response id read from bodies and streams; facts carry the id."""

from __future__ import annotations

import orjson

from extproc.core.api import Api
from extproc.core.chains import ChainSketch
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules, KeySource, hash_key
from extproc.core.response_links import (
    MAX_ID_CHARS,
    link_name,
    make_link,
    read_link,
    valid_response_id,
)
from extproc.core.usage import SseUsageScanner, response_id_from_body

JSON = {"content-type": "application/json"}


def test_a_link_reads_back_only_under_its_secret_and_id() -> None:
    session = hash_key(KeySource.PREFIX, b"chain\x1fabc", b"s1")
    link = make_link(b"s1", "resp_1", session)
    assert link.name == link_name(b"s1", "resp_1") and len(link.name) == 16
    assert session.digest not in link.value and b"resp_1" not in link.name + link.value
    back = read_link(b"s1", "resp_1", link.value)
    assert back == session
    # Another id or secret unseals to some other digest: never this session.
    for secret, rid in ((b"s2", "resp_1"), (b"s1", "resp_2")):
        other = read_link(secret, rid, link.value)
        assert other is None or other.digest != session.digest
    assert link_name(b"s2", "resp_1") != link.name
    # Each id gets its own pad: one session linked twice gives unrelated values.
    assert make_link(b"s1", "resp_2", session).value[1:] != link.value[1:]


def test_foreign_values_are_ignored() -> None:
    assert read_link(b"s", "resp_1", b"") is None
    assert read_link(b"s", "resp_1", b"\x00" * 5) is None
    assert read_link(b"s", "resp_1", b"\x09" + b"\x00" * 16) is None  # no such source


def test_only_sane_ids_are_followed() -> None:
    assert valid_response_id("resp_abc") == "resp_abc"
    for bad in ("", None, 7, ["resp_1"], "r" * (MAX_ID_CHARS + 1)):
        assert valid_response_id(bad) is None


def test_the_response_id_of_a_body_and_of_a_stream() -> None:
    body = orjson.dumps({"id": "resp_9", "object": "response", "usage": None})
    assert response_id_from_body(body) == "resp_9"
    assert (
        response_id_from_body(b'{"error": {"message": "Response with id ... not found."}}') is None
    )
    assert response_id_from_body(b'{"id": "chatcmpl-1", "object": "chat.completion"}') is None
    assert response_id_from_body(b'not json, mentions "response"') is None
    scanner = SseUsageScanner(Api.OPENAI_RESPONSES)
    created = orjson.dumps(
        {"type": "response.created", "response": {"id": "resp_7", "object": "response"}}
    )
    event = b"event: response.created\ndata: " + created + b"\n\n"
    scanner.feed(event[:17])
    assert scanner.response_id is None
    scanner.feed(event[17:])
    assert scanner.response_id == "resp_7"
    chat = SseUsageScanner(Api.OPENAI_CHAT)
    chat.feed(event)
    assert chat.response_id is None


def test_facts_carry_previous_response_id_and_chained_turns_teach_the_sketch_nothing() -> None:
    sketch = ChainSketch()
    rules = KeyRules(sketch=sketch)
    body = {"model": "m", "input": "just the new input", "previous_response_id": "resp_1"}
    facts = parse_request("/v1/responses", JSON, orjson.dumps(body), rules, ParseLimits())
    assert isinstance(facts, RequestFacts)
    assert facts.previous_response_id == "resp_1"
    assert sketch.group_count == 0  # not a conversation of its own
    del body["previous_response_id"]
    facts = parse_request("/v1/responses", JSON, orjson.dumps(body), rules, ParseLimits())
    assert isinstance(facts, RequestFacts) and facts.previous_response_id is None
    assert sketch.group_count == 1
    # Other APIs have no such field: ignored.
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    chat["previous_response_id"] = "resp_1"  # type: ignore[assignment]
    facts = parse_request("/v1/chat/completions", JSON, orjson.dumps(chat), rules, ParseLimits())
    assert isinstance(facts, RequestFacts) and facts.previous_response_id is None
