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
