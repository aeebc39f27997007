"""The simulator keys a layout's sessions with the processor's own key function on the
requests' prompts (not by their first block, which made a shared opening one session)."""

from __future__ import annotations

from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules
from extproc.harness.layouts import LayoutConfig, generate_layout
from extproc.sim.scenario import SimOptions, build
from extproc.sim.traffic import base_from_requests, processor_sessions


def test_old_key_makes_one_session_and_the_chain_key_one_per_conversation() -> None:
    requests = generate_layout(LayoutConfig(layout="first-user", conversations=120, doc_share=0))
    old = base_from_requests(requests, "t", "opening")
    new = base_from_requests(requests, "t", "chain")
    assert old.n_sessions == 1
    # Conversations begun before the opening was learnt share its key (grandfathered).
    assert new.n_sessions >= 110


def test_sessions_carry_the_processors_own_placement_point() -> None:
    requests = generate_layout(LayoutConfig(layout="tools", conversations=20, doc_share=0))
    labels = processor_sessions(requests, "opening", 8)
    body = requests[0].materialize()
    import orjson

    facts = parse_request(
        requests[0].path,
        {"content-type": "application/json"},
        orjson.dumps(body),
        KeyRules(header=None, body_fields=(), prefix_key="opening"),
        ParseLimits(),
    )
    assert isinstance(facts, RequestFacts)
    assert labels[0] == "key:" + facts.session.digest.hex()
    options = SimOptions(layout="tools", layout_conversations=20, key="opening", sessions=40)
    prepared = build(options)
    first = prepared.scenario.traffic.points[0]
    assert int(first) == facts.session.point or prepared.scenario.traffic.copies == 2


def test_a_layout_fleet_is_sized_for_a_spread_the_same_for_both_keys() -> None:
    """A block shared by s conversations lives on min(s, N) clusters when they are spread: the
    32 KB completions preamble (one tenant, every conversation) is held by every cluster."""
    requests = generate_layout(
        LayoutConfig(layout="completions-32k", conversations=40, turns=1, doc_share=0)
    )
    base = base_from_requests(requests, "t", "chain", clusters=8)
    assert base.spread_keys is not None
    # The blocks every conversation holds: the preamble's (8 KiB tokens, 16 per block).
    preamble = set.intersection(*(set(k) for k in base.keys))
    assert len(preamble) * base.block_tokens >= 7_000
    # Each counts 8 times (clusters), so the spread holds 7 more copies of it than one cache.
    assert base.spread_keys - base.n_keys >= 7 * len(preamble)
    assert base.spread_keys <= 8 * base.n_keys
    # Sized from the spread (the layout default), both keys get the same fleet, with more KV
    # per cluster than from one ideal cache; --sizing ideal keeps the old rule.
    fleets = {}
    for key in ("opening", "chain"):
        for sizing in ("spread", "ideal"):
            options = SimOptions(
                layout="completions-32k",
                layout_conversations=40,
                key=key,
                sizing=None if sizing == "spread" else sizing,
            )
            fleets[key, sizing] = build(options).scenario.clusters
    assert fleets["opening", "spread"] == fleets["chain", "spread"]
    spread_kv = fleets["chain", "spread"][0].kv_capacity_tokens
    ideal_kv = fleets["chain", "ideal"][0].kv_capacity_tokens
    assert spread_kv > 2 * ideal_kv
    assert fleets["chain", "spread"][0].prefill_tps > fleets["chain", "ideal"][0].prefill_tps


def test_one_conversation_per_block_sizes_as_one_cache() -> None:
    # Private blocks only (distinct conversations, no shared opening beyond a block): the
    # spread counts each key once, as one cache would.
    requests = generate_layout(LayoutConfig(layout="system", conversations=1, turns=3))
    base = base_from_requests(requests, "t", "session", clusters=64)
    assert base.spread_keys == base.n_keys
