"""json_body.loads answers every body exactly as orjson.loads does: the same document (types,
key order, values) or the same error, hostile input included; and it does not hand ordinary
bodies to orjson (the point of it)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core import json_body
from extproc.reliability.fuzz_cases import encode, json_values, mutated_body


@pytest.fixture(autouse=True, scope="module")
def _every_body_through_msgspec() -> Iterator[None]:
    """Small bodies go straight to orjson; here every body takes the msgspec path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_body, "SMALL_BODY", 0)
        yield


def _same(a: object, b: object) -> bool:
    """Equal documents: the same types (1 is not 1.0), key order, values and zero signs.
    Iterative: the documents nest up to 1024 levels."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict) and isinstance(y, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif isinstance(x, float) and isinstance(y, float):
            if x != y or math.copysign(1, x) != math.copysign(1, y):
                return False
        elif x != y:
            return False
    return True


def _answer(loads: Any, body: bytes) -> tuple[str, object]:
    try:
        return "doc", loads(body)
    except orjson.JSONDecodeError as exc:
        return "error", str(exc)


def assert_same_answer(body: bytes) -> None:
    expected = _answer(orjson.loads, body)
    got = _answer(json_body.loads, body)
    assert got[0] == expected[0], (body[:200], got, expected)
    if got[0] == "error":
        assert got[1] == expected[1]
    else:
        assert _same(got[1], expected[1]), body[:200]


WIDE = [
    b"18446744073709551615",  # 2**64 - 1: orjson keeps it an int
    b"18446744073709551616",  # 2**64: orjson gives a float
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"123456789012345678901234567890",
    b"1" + b"0" * 308,  # still a finite double
    b"1" + b"0" * 309,  # infinity: orjson refuses it, msgspec keeps the int
    b"1" + b"0" * 5000,
]
HOSTILE: list[bytes] = [
    *(b'{"max_tokens": ' + n + b', "messages": []}' for n in WIDE),
    *(b"[" + b", ".join([b"1"] * 40 + [n] + [b"2"] * 40) + b"]" for n in WIDE),
    *(b'{"prompt": [' + b", ".join([b"1.5"] * 20 + [n]) + b"]}" for n in WIDE),
    *(b'{"a": {"b": [{"c": ' + n + b"}]}}" for n in WIDE),
    *WIDE,
    b"[" + b", ".join([b"1e300"] * 20) + b"]",
    b"[" + b", ".join([b"-1e30"] * 20) + b"]",
    b"[" + b", ".join([b'"s"'] * 30 + [b"18446744073709551616"]) + b"]",
    b"[" + b", ".join([b"[1]"] * 30 + [b"[18446744073709551616]"]) + b"]",
    b'{"a": 1e400}',
    b'{"a": -1e400}',
    b'{"a": 1e-400}',
    b'{"a": -0.0, "b": -0, "c": 0e0, "d": 5e-324, "e": 1.7976931348623157e308}',
    b'{"a": NaN}',
    b'{"a": "\\ud800"}',
    b'{"a": "\\udc00"}',
    b'{"a": "\\ud800\\u0041"}',
    b'{"a": "\\ud83d\\ude00"}',
    b'{"\\ud800": 1}',
    b'{"a": "\xed\xa0\x80"}',
    b'{"a": "\xff"}',
    b'{"a": "\xc3"}',
    b'{"a": "\xc0\xaf"}',
    b"\xef\xbb\xbf{}",
    b'{"a": 1, "b": 2, "a": 3}',
    b'{"a": 1} x',
    b'{"a": 1}\x00',
    b'{"a": "x\x01y"}',
    b"   ",
    b"",
    b'{"a": 01}',
    b'{"a": +1}',
    b'{"a": .5}',
    b'{"a": 1.}',
    b'"\\u0000"',
    *(b"[" * depth + b"]" * depth for depth in (999, 1000, 1001, 1023, 1024, 1025, 5000)),
    *(b'{"a":' * depth + b"1" + b"}" * depth for depth in (999, 1023, 1024, 1025)),
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_get_orjsons_answer(body: bytes) -> None:
    assert_same_answer(body)


def test_a_recursion_limit_above_orjsons_depth_limit_leaves_the_body_to_orjson() -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        for depth in (1024, 1025, 3000):
            assert_same_answer(b"[" * depth + b"]" * depth)
    finally:
        sys.setrecursionlimit(old)


@settings(
    derandomize=True,
    database=None,
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.sampled_from(["chat", "messages", "completions", "responses"]).flatmap(mutated_body))
def test_fuzzed_request_bodies_get_orjsons_answer(drawn: tuple[bytes, Any, Any]) -> None:
    assert_same_answer(drawn[0])


@settings(derandomize=True, database=None, max_examples=400, deadline=None)
@given(json_values, st.booleans())
def test_any_json_value_gets_orjsons_answer(value: Any, ascii_only: bool) -> None:
    assert_same_answer(encode(value, ascii_only))


@settings(derandomize=True, database=None, max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**80), max_value=2**80), min_size=16, max_size=64))
def test_integer_lists_at_any_width_get_orjsons_answer(values: list[int]) -> None:
    assert_same_answer(orjson.dumps([str(v) for v in values]).replace(b'"', b""))


def test_a_body_below_the_threshold_is_orjsons_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_body, "SMALL_BODY", 64 << 10)
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 1000}]})
    expected = orjson.loads(body)
    seen: list[bytes] = []
    real = json_body.orjson.loads

    def spy(body: bytes) -> object:
        seen.append(body)
        return real(body)

    monkeypatch.setattr(json_body.orjson, "loads", spy)
    assert json_body.loads(body) == expected
    assert seen == [body]


def test_an_ordinary_body_is_not_handed_to_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "é ✓ " * 5000}] * 50,
            "max_tokens": 16,
            "prompt": list(range(1000)),
        }
    )
    expected = orjson.loads(body)

    def refuse(_body: bytes) -> object:
        raise AssertionError("handed to orjson")

    monkeypatch.setattr(json_body.orjson, "loads", refuse)
    assert _same(json_body.loads(body), expected)
