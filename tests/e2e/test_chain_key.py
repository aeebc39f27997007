"""The chain key through a real Envoy and processor: conversations behind a shared opening in
the first user message (where the old key sent everything to one cluster) keep their turns on
one cluster, spread over the fleet, and requests sharing a document stay together."""

from __future__ import annotations

from collections import Counter, defaultdict

import orjson
import pytest

from extproc.harness.launch import Client, FleetStack
from extproc.harness.layouts import LayoutConfig, generate_layout
from tests.e2e.conftest import dump_logs


@pytest.mark.parametrize("layout", ["first-user", "completions-8k"])
def test_chain_key_through_envoy(tmp_path_factory: pytest.TempPathFactory, layout: str) -> None:
    requests = generate_layout(
        LayoutConfig(
            layout=layout,
            conversations=80,
            turns=3,
            documents=4,
            doc_share=0.3,
            opening_chars=4000,
            doc_chars=3000,
        )
    )
    stack = FleetStack(
        tmp_path_factory.mktemp("chain"),
        clusters=4,
        fleet_overrides={"prefix": {"key": "chain"}},
        access_log=False,
    )
    with stack:
        client = Client(stack.listener_port)
        first: dict[str, str] = {}
        later = kept = 0
        starts: Counter[str] = Counter()
        warm: set[str] = set()  # conversations that started after the warm-up
        docs: dict[str, Counter[str]] = defaultdict(Counter)
        try:
            for n, request in enumerate(requests):
                body = orjson.dumps(request.materialize())
                status, hdrs, data = client.post_json(request.path, body, {})
                assert status == 200, (data, dump_logs(stack))
                cluster = hdrs["x-served-by"]
                sid = request.session_id or ""
                if sid in first:
                    later += 1
                    kept += cluster == first[sid]
                else:
                    first[sid] = cluster
                    if n >= 20:  # past the warm-up (the opening is learnt after 4)
                        starts[cluster] += 1
                        warm.add(sid)
                # Conversations begun during the warm-up keep their first key (grandfathered).
                if request.kind.startswith("doc") and sid in warm:
                    docs[request.kind][cluster] += 1
        finally:
            client.close()
    assert kept / later >= 0.99, (kept, later)
    assert len(starts) == 4 and max(starts.values()) <= 0.5 * sum(starts.values()), starts
    assert all(len(clusters) == 1 for clusters in docs.values()), docs
