"""Mooncake-format request traces: reading, prompt synthesis, and the ideal prefix-hit ratio.

One JSON object per line: ``timestamp`` (ms from trace start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the prompt; two requests
sharing a leading run of ids share that prefix). Any file in this format is accepted; lines that
do not fit are skipped and reported with their line numbers, never silently dropped.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.harness.prompts import API_PATHS, BLOCK_TOKENS, ApiKind, TextSynth
from extproc.harness.workload import ReplayRequest


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # 1-based line number in the source file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    @property
    def session(self) -> int:
        """Requests whose first block id is equal belong to the same session."""
        return self.hash_ids[0]


@dataclass(frozen=True, slots=True)
class TraceIssue:
    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    issues: tuple[TraceIssue, ...] = ()
    # Lines whose number of ids does not match ceil(input_length / 512); kept, but worth knowing.
    length_mismatches: int = 0
    source: str = field(default="")


def _int_field(obj: dict[str, Any], name: str, minimum: int) -> int:
    value = obj.get(name)
    # bool is an int subclass; a trace with "input_length": true is malformed, not 1 token.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _parse_line(line_no: int, text: str) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    timestamp = obj.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise ValueError("timestamp must be a number")
    if not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"timestamp must be finite and >= 0, got {timestamp!r}")
    input_length = _int_field(obj, "input_length", 1)
    output_length = _int_field(obj, "output_length", 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("hash_ids must be a non-empty list")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError("hash_ids must be non-negative integers")
    return TraceRequest(line_no, float(timestamp), input_length, output_length, tuple(ids))


def parse_trace(lines: Iterable[str], source: str = "") -> Trace:
    """Parse trace lines; requests are returned sorted by timestamp (stable)."""
    requests: list[TraceRequest] = []
    issues: list[TraceIssue] = []
    mismatches = 0
    for line_no, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            request = _parse_line(line_no, text)
        except ValueError as exc:
            issues.append(TraceIssue(line_no, str(exc)))
            continue
        if len(request.hash_ids) != math.ceil(request.input_length / BLOCK_TOKENS):
            mismatches += 1
        requests.append(request)
    requests.sort(key=lambda r: r.timestamp_ms)
    return Trace(tuple(requests), tuple(issues), mismatches, source)


def read_trace(path: str | Path) -> Trace:
    with open(path, encoding="utf-8") as handle:
        return parse_trace(handle, source=str(path))


def _prefix_walk(requests: Sequence[TraceRequest]) -> tuple[list[int], int]:
    """Walk the trace through one trie of chained block ids (a block is identified by the whole
    prefix up to it, not by its id alone): per request, the leading run of blocks already seen;
    and the number of distinct prefix blocks in the whole trace."""
    trie: dict[tuple[int, int], int] = {}
    leading_runs: list[int] = []
    for request in requests:
        node = 0
        leading = 0
        still_hitting = True
        for block_id in request.hash_ids:
            key = (node, block_id)
            child = trie.get(key)
            if child is None:
                child = len(trie) + 1
                trie[key] = child
                still_hitting = False
            elif still_hitting:
                leading += 1
            node = child
        leading_runs.append(leading)
    return leading_runs, len(trie)


def ideal_hit_ratio(requests: Sequence[TraceRequest]) -> float:
    """Token-weighted hit ratio of one infinite prefix cache serving the whole trace in order.

    Cached tokens of a request are its leading run of blocks seen before, 512 tokens each
    except a final partial block.
    """
    leading_runs, _distinct = _prefix_walk(requests)
    cached_total = sum(
        min(leading * BLOCK_TOKENS, r.input_length)
        for leading, r in zip(leading_runs, requests, strict=True)
    )
    prompt_total = sum(r.input_length for r in requests)
    return cached_total / prompt_total if prompt_total else 0.0


def working_set_tokens(requests: Sequence[TraceRequest]) -> int:
    """Tokens of distinct prefix blocks: what a fleet must hold to cache every prefix once."""
    return _prefix_walk(requests)[1] * BLOCK_TOKENS


def trace_to_requests(
    trace: Trace | Sequence[TraceRequest],
    *,
    synth: TextSynth | None = None,
    api: ApiKind = "openai-chat",
    model: str = "sim",
    session_header_share: float = 0.5,
    stream: bool = True,
    seed: int = 0,
) -> list[ReplayRequest]:
    """One replay request per trace line: a single user message holding the synthesised prompt.

    Prompts are synthesised lazily at send time (a 3,993-line trace holds ~240 MB of prompt
    text). Whether a session sends its id header is drawn once per session, so all requests of
    a session behave alike.
    """
    requests = trace.requests if isinstance(trace, Trace) else tuple(trace)
    text_synth = synth if synth is not None else TextSynth(seed)
    rng = random.Random(f"{seed}:trace-sessions")
    header_for: dict[int, bool] = {}
    out: list[ReplayRequest] = []
    for request in requests:
        session = request.session
        if session not in header_for:
            header_for[session] = rng.random() < session_header_share
        out.append(
            ReplayRequest(
                arrival_s=request.arrival_s,
                api=api,
                path=API_PATHS[api],
                body=_LazyTraceBody(text_synth, request, api, model, stream),
                session_id=f"trace-{session}",
                send_session_header=header_for[session],
                kind="trace",
                input_tokens=request.input_length,
                stream=stream,
                max_tokens=max(1, request.output_length),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _LazyTraceBody:
    synth: TextSynth
    request: TraceRequest
    api: ApiKind
    model: str
    stream: bool

    def __call__(self) -> dict[str, Any]:
        request = self.request
        prompt = self.synth.trace_prompt(
            request.hash_ids, request.input_length, filler_key=f"line{request.line}"
        )
        max_tokens = max(1, request.output_length)
        if self.api == "openai-completions":
            return {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": self.stream,
            }
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": self.stream,
        }
