"""Decoding a request body: msgspec's speed, orjson's answers.

orjson is the reference: every answer the processor gives to a body (the document, or the
400 with orjson's reason) is the one ``orjson.loads`` gives. msgspec decodes the same documents
faster (a 4 MiB chat body in about a third of orjson's time; BENCHMARKS.md),
but it answers a few hostile inputs differently:

- integers outside [-2**63, 2**64): msgspec keeps them exact; orjson turns them into floats,
  and refuses those beyond a double's range ("number is infinity");
- nesting: msgspec stops at Python's recursion limit (1000 by default), orjson at 1024 levels;
- its error messages.

So msgspec decodes, and orjson answers whenever the two could differ: on any msgspec error,
and when the document holds an integer outside that range (or a number list whose bounds
cannot rule one out). Nesting needs no check: msgspec accepts fewer levels than orjson as long
as the recursion limit is at most 1024, which :func:`loads` checks.

A walk of the decoded document looks for the wide integers. It visits containers, not
characters: a list of numbers or of strings is checked by its min and max in C. Its work is
bounded by the body's size (a document denser than that is handed to orjson), so a hostile
body costs at most about twice what orjson alone would.
"""

from __future__ import annotations

import sys

import msgspec
import orjson

_DECODER = msgspec.json.Decoder()
# orjson keeps integers in [-2**63, 2**64) and turns the others into floats.
_LO = -(1 << 63)
_HI = (1 << 64) - 1
# orjson's nesting limit: with a recursion limit above it, msgspec could accept deeper documents.
_ORJSON_DEPTH = 1024
# Values the walk may visit one by one: one per this many body bytes (a chat message is
# hundreds of bytes or more); past it, orjson decodes.
_BYTES_PER_VALUE = 32
# Below this size orjson is as fast (measured at 1 KB and 64 KB: `extproc bench handler`), and
# the walk would cost more than it saves.
SMALL_BODY = 64 << 10
# Lists shorter than this are walked one value at a time (min/max costs more on a few values).
_BOUNDS_FROM = 16


def loads(body: bytes) -> object:
    """``orjson.loads(body)``'s document, or its :class:`orjson.JSONDecodeError`."""
    if len(body) < SMALL_BODY or sys.getrecursionlimit() > _ORJSON_DEPTH:
        return orjson.loads(body)
    try:
        doc = _DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError, ValueError):
        # Whatever msgspec refuses, orjson answers: the same refusal with orjson's reason, or
        # the document (orjson accepts a few that msgspec does not, e.g. 1000-1024 levels).
        return orjson.loads(body)
    if _may_differ(doc, len(body) // _BYTES_PER_VALUE + 64):
        return orjson.loads(body)
    return doc


def _may_differ(doc: object, budget: int) -> bool:
    """Whether orjson could decode ``doc``'s source differently: it holds an integer outside
    [-2**63, 2**64) — or the walk could not rule one out within ``budget`` values."""
    if type(doc) is int:
        return not _LO <= doc <= _HI
    if type(doc) is not dict and type(doc) is not list:
        return False
    stack: list[object] = [doc]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            values: object = node.values()
            count = len(node)
        else:
            assert type(node) is list
            values = node
            count = len(node)
            if count >= _BOUNDS_FROM:
                bounded = _bounded(node)
                if bounded is not None:
                    if not bounded:
                        return True
                    continue
        budget -= count
        if budget < 0:
            return True
        for value in values:  # type: ignore[attr-defined]
            kind = type(value)
            if kind is int:
                if not _LO <= value <= _HI:
                    return True
            elif kind is dict or kind is list:
                stack.append(value)
    return False


def _bounded(values: list[object]) -> bool | None:
    """For a list of numbers only, or of strings only: whether no integer in it is out of
    range (False for a float past the range too: the bounds cannot tell). None: another kind
    of list (containers, mixed kinds), to be walked value by value."""
    try:
        lo = min(values)  # type: ignore[type-var]
        hi = max(values)  # type: ignore[type-var]
    except TypeError:  # kinds that do not compare (str beside int, dicts): walk them
        return None
    if type(lo) is str:
        return True  # str compares only with str: no number in the list
    if type(lo) in (int, float, bool) and type(hi) in (int, float, bool):
        return bool(lo >= _LO and hi <= _HI)  # type: ignore[operator]
    return None  # lists of lists compare too: walk them
