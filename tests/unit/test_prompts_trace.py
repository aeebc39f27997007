"""Prompt synthesis, canonicalisation, block hashing, the trace reader and the ideal hit ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.harness.prompts import (
    BLOCK_CHARS,
    PromptError,
    TextSynth,
    block_hashes,
    canonical_prompt,
    count_tokens,
)
from extproc.harness.trace import (
    TraceRequest,
    ideal_hit_ratio,
    parse_trace,
    read_trace,
    trace_to_requests,
)

REPO = Path(__file__).resolve().parents[2]
# Vendored with its README (upstream, license) in third_party/mooncake/.
MOONCAKE_TRACE = REPO / "third_party" / "mooncake" / "mooncake_synthetic_trace.jsonl"


def line(ts: float, length: int, ids: list[int], out: int = 10) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}
    )


# -- text synthesis ---------------------------------------------------------------------------


def test_same_block_id_gives_the_same_text_across_instances() -> None:
    a, b = TextSynth(seed=0), TextSynth(seed=0)
    assert a.block(42) == b.block(42)
    assert len(a.block(42)) == BLOCK_CHARS


def test_different_block_ids_and_seeds_give_different_text() -> None:
    synth = TextSynth(seed=0)
    texts = {synth.block(i) for i in range(200)}
    assert len(texts) == 200
    assert TextSynth(seed=1).block(42) != synth.block(42)


def test_block_cache_is_bounded_and_transparent() -> None:
    synth = TextSynth(seed=0, cache_blocks=2)
    first = synth.block(1)
    for i in range(2, 10):
        synth.block(i)
    assert synth.block(1) == first


def test_trace_prompt_has_input_length_times_four_chars() -> None:
    synth = TextSynth()
    assert len(synth.trace_prompt([1, 2, 3], 1300)) == 1300 * 4
    assert len(synth.trace_prompt([1, 2, 3], 1536)) == 1536 * 4


def test_shared_leading_ids_share_exactly_that_text_prefix() -> None:
    synth = TextSynth()
    a = synth.trace_prompt([5, 6, 7, 8], 2048)
    b = synth.trace_prompt([5, 6, 70, 8], 2048)
    assert a[: 2 * BLOCK_CHARS] == b[: 2 * BLOCK_CHARS]
    assert a[2 * BLOCK_CHARS : 3 * BLOCK_CHARS] != b[2 * BLOCK_CHARS : 3 * BLOCK_CHARS]
    # Same block id in the same position after a divergence is the same text again.
    assert a[3 * BLOCK_CHARS :] == b[3 * BLOCK_CHARS :]


def test_missing_ids_are_filled_with_text_unique_to_the_request() -> None:
    synth = TextSynth()
    a = synth.trace_prompt([1], 1024, filler_key="a")
    b = synth.trace_prompt([1], 1024, filler_key="b")
    assert len(a) == len(b) == 4096
    assert a[:BLOCK_CHARS] == b[:BLOCK_CHARS]
    assert a[BLOCK_CHARS:] != b[BLOCK_CHARS:]


def test_text_is_deterministic_per_key() -> None:
    synth = TextSynth(seed=3)
    assert synth.text("k", 1000) == TextSynth(seed=3).text("k", 1000)
    assert synth.text("k", 1000) != synth.text("j", 1000)
    assert len(synth.text("k", 1000)) == 1000
    assert synth.text("k", 0) == ""


# -- hashing and canonical prompts ----------------------------------------------------------------


def test_block_hashes_cover_full_blocks_only_and_chain() -> None:
    synth = TextSynth()
    text = synth.trace_prompt([1, 2, 3], 1400)  # 2 full blocks + a partial one
    hashes = block_hashes(text)
    assert len(hashes) == 2
    other = synth.trace_prompt([1, 9, 3], 1536)
    assert block_hashes(other)[0] == hashes[0]
    assert block_hashes(other)[1] != hashes[1]
    # Changing the first block changes every later hash: hashes identify whole prefixes.
    moved = synth.trace_prompt([4, 2, 3], 1536)
    assert not set(block_hashes(moved)) & set(hashes)


def test_count_tokens_rounds_up_at_four_chars_per_token() -> None:
    assert count_tokens("") == 0
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2


def test_a_later_chat_turn_extends_the_earlier_canonical_prompt() -> None:
    turn1 = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "q2"}]},
        ]
    }
    first = canonical_prompt("openai-chat", turn1)
    second = canonical_prompt("openai-chat", turn2)
    assert second.startswith(first)
    assert "q2" in second


def test_anthropic_system_and_content_blocks_are_part_of_the_prompt() -> None:
    body = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    }
    text = canonical_prompt("anthropic-messages", body)
    assert text.index("be brief") < text.index("hello")


def test_completions_prompt_is_used_verbatim() -> None:
    assert canonical_prompt("openai-completions", {"prompt": "abc"}) == "abc"
    assert canonical_prompt("openai-completions", {"prompt": ["a", "b"]}) == "a\nb"


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("openai-chat", {}),
        ("openai-chat", {"messages": []}),
        ("openai-chat", {"messages": [{"content": "no role"}]}),
        ("openai-chat", {"messages": [{"role": "user", "content": 5}]}),
        ("openai-completions", {"prompt": 3}),
        ("anthropic-messages", {"system": 1, "messages": [{"role": "user", "content": "x"}]}),
    ],
    ids=["no-messages", "empty", "no-role", "bad-content", "bad-prompt", "bad-system"],
)
def test_malformed_bodies_raise_prompt_error(api: str, body: dict[str, object]) -> None:
    with pytest.raises(PromptError):
        canonical_prompt(api, body)  # type: ignore[arg-type]


# -- trace reader ----------------------------------------------------------------------------


def test_malformed_lines_are_skipped_and_reported_with_line_numbers() -> None:
    lines = [
        line(0, 600, [1, 2]),
        "{not json",
        "",
        json.dumps({"timestamp": 5, "input_length": 10, "output_length": 1}),
        json.dumps({"timestamp": 5, "input_length": True, "output_length": 1, "hash_ids": [1]}),
        line(-1, 10, [1]),
        json.dumps([1, 2]),
        line(7, 10, [1, -2]),
        line(3, 500, [1]),
    ]
    trace = parse_trace(lines)
    assert [r.line for r in trace.requests] == [1, 9]
    assert [issue.line for issue in trace.issues] == [2, 4, 5, 6, 7, 8]
    assert "hash_ids" in trace.issues[1].reason


def test_requests_are_sorted_by_timestamp_and_sessions_follow_the_first_id() -> None:
    trace = parse_trace([line(20, 512, [7]), line(10, 512, [3, 4]), line(15, 1024, [7, 8])])
    assert [r.timestamp_ms for r in trace.requests] == [10, 15, 20]
    assert [r.session for r in trace.requests] == [3, 7, 7]
    assert trace.requests[0].arrival_s == pytest.approx(0.01)


def test_id_count_mismatches_are_counted_not_rejected() -> None:
    trace = parse_trace([line(0, 2000, [1]), line(1, 512, [1])])
    assert len(trace.requests) == 2
    assert trace.length_mismatches == 1


def test_ideal_hit_ratio_of_a_hand_made_trace() -> None:
    requests = [
        TraceRequest(1, 0, 1536, 1, (1, 2, 3)),  # all new
        TraceRequest(2, 1, 1536, 1, (1, 2, 4)),  # blocks 1, 2 seen as a prefix: 1024
        TraceRequest(3, 2, 1536, 1, (9, 2, 3)),  # block 2 seen, but never after 9: 0
        TraceRequest(4, 3, 1400, 1, (1, 2, 3)),  # whole prompt seen: 1400 (partial last block)
    ]
    assert ideal_hit_ratio(requests) == pytest.approx((1024 + 1400) / (3 * 1536 + 1400))
    assert ideal_hit_ratio([]) == 0.0


def test_read_trace_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line(0, 512, [1]), "oops", line(1, 512, [1])]) + "\n")
    trace = read_trace(path)
    assert len(trace.requests) == 2
    assert trace.issues[0].line == 2
    assert ideal_hit_ratio(trace.requests) == pytest.approx(0.5)


def test_the_shared_mooncake_trace_reads_cleanly() -> None:
    trace = read_trace(MOONCAKE_TRACE)
    assert len(trace.requests) == 3993
    assert trace.issues == ()
    assert trace.length_mismatches == 0
    assert ideal_hit_ratio(trace.requests) == pytest.approx(0.6512, abs=1e-3)


def test_trace_requests_build_lazy_bodies_with_the_synthesised_prompt() -> None:
    trace = parse_trace(
        [line(0, 1024, [1, 2], out=7), line(500, 1024, [1, 3], out=0), line(900, 512, [5])]
    )
    requests = trace_to_requests(trace, session_header_share=1.0, stream=False)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 0.9]
    assert [r.max_tokens for r in requests] == [7, 1, 10]  # output_length 0 still asks for 1
    assert [r.session_id for r in requests] == ["trace-1", "trace-1", "trace-5"]
    assert all(r.send_session_header for r in requests)
    body = requests[0].materialize()
    assert body["max_tokens"] == 7 and body["stream"] is False
    prompt = body["messages"][0]["content"]
    assert prompt == TextSynth().trace_prompt([1, 2], 1024)
    shared = block_hashes(canonical_prompt("openai-chat", requests[1].materialize()))
    assert block_hashes(canonical_prompt("openai-chat", body))[:1] == shared[:1]


def test_session_header_choice_is_per_session() -> None:
    lines = [line(i, 512, [i % 10, 100 + i]) for i in range(200)]
    requests = trace_to_requests(parse_trace(lines), session_header_share=0.5)
    by_session: dict[str | None, set[bool]] = {}
    for r in requests:
        by_session.setdefault(r.session_id, set()).add(r.send_session_header)
    assert all(len(choices) == 1 for choices in by_session.values())
