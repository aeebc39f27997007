"""The ideal arm of `extproc bench real-affinity`: one infinite prefix cache replayed over a
trace of tokenized prompts, counted as vLLM counts its prefix-cache hits and queries."""

from __future__ import annotations

from extproc.bench.real_affinity import ideal_hits


def test_a_first_prompt_hits_nothing_and_a_repeat_hits_all_but_its_last_block() -> None:
    prompt = list(range(8))
    assert ideal_hits([prompt], 4) == (0, 8)
    # The repeat's last token is always computed: of its two full blocks only the first hits.
    assert ideal_hits([prompt, prompt], 4) == (4, 16)
    longer = [*prompt, 99]
    assert ideal_hits([prompt, longer], 4) == (8, 17)


def test_blocks_are_chained_from_the_start_and_partial_blocks_are_not_cached() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # The same second block after another first block is another block.
    b = [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert ideal_hits([a, b], 4) == (0, 18)
    # A shared opening shorter than a block is no hit.
    assert ideal_hits([[1, 2, 3], [1, 2, 3, 4, 5]], 4) == (0, 8)


def test_a_conversation_replayed_turn_by_turn_hits_its_whole_history() -> None:
    system = list(range(100, 108))  # two blocks shared by every conversation
    one, two = [*system, 1, 1, 1, 1], [*system, 2, 2, 2, 2]
    trace = [one, two, [*one, 5, 5, 5, 5, 6], [*two, 5, 5, 5, 5, 6]]
    hits, queries = ideal_hits(trace, 4)
    # two: the system blocks; each second turn: its first turn's three blocks, not the block
    # its new tokens fill (cached only now) nor the partial fifth.
    assert (hits, queries) == (8 + 12 + 12, 12 + 12 + 17 + 17)
