"""A restarted processor keys conversations as the other replicas do from its first request.

The chain key (the default prefix key) skips an opening many conversations share once the
replica's sketch has learnt it as common (extproc.core.chains); a replica that starts with an
empty sketch keys a new conversation behind that opening on the opening itself: another
session, another placement, a cold prefix cache, until it has seen the opening in
``common_after`` conversations again. With Redis, `extproc serve` merges the promotions every
replica published before it reports ready (Service._warm_chains), so nothing of that warm-up
is left. Checked on a real `extproc serve` against a real redis-server, through /explain.
"""

from __future__ import annotations

import dataclasses
import http.client
import sys
from pathlib import Path

import orjson
import yaml

from extproc.config import load_runtime
from extproc.core.chains import ChainSketch
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules
from extproc.harness.launch import Proc, wait_until
from extproc.ledger.redis_client import bounded_client
from extproc.pipeline.chain_sync import ChainSync
from tests.stream.test_chain_sync import turn_body
from tests.support.redis_server import RedisServer

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"


def _label(body: bytes, rules: KeyRules) -> str:
    facts = parse_request(CHAT, JSON, body, rules, ParseLimits())
    assert isinstance(facts, RequestFacts), facts
    return facts.session.label


def _config(tmp: Path, url: str) -> Path:
    secret = tmp / "label-secret"
    secret.write_bytes(b"restart-warm-test-secret-0123456789")
    doc = {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:{8000 + i}"]} for i in (1, 2, 3)],
        "classes": [{"name": "any"}],
        "session": {"label_secret_file": str(secret)},
        "redis": {"url": url, "timeout_ms": 1000},
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _serve(tmp: Path, config: Path) -> tuple[Proc, int]:
    argv = [sys.executable, "-m", "extproc", "serve", "--config", str(config)]
    argv += ["--port", "0", "--metrics-port", "0", "--drain-delay", "0"]
    proc = Proc("extproc", argv, tmp / "extproc.log")
    proc.start()
    ports: dict[str, str] = {}

    def ready() -> bool:
        if not proc.alive:
            raise RuntimeError(proc.log_text()[-3000:])
        for line in proc.log_text().splitlines():
            if line.startswith("READY "):
                ports.update(kv.split("=") for kv in line.split()[1:])
                return True
        return False

    try:
        wait_until(ready, 60, "extproc READY")
    except BaseException:
        proc.stop()
        raise
    return proc, int(ports["metrics"])


def _explain_label(port: int, body: bytes) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/explain?path={CHAT}", body, JSON)
        answer = conn.getresponse()
        doc = orjson.loads(answer.read())
    finally:
        conn.close()
    assert answer.status == 200, doc
    return str(doc["facts"]["session"])


async def test_a_restarted_replica_keys_new_conversations_as_its_peers_at_once(
    tmp_path: Path,
) -> None:
    with RedisServer() as server:
        config = _config(tmp_path, server.url)
        runtime = load_runtime(str(config))
        # A peer that has served: it learnt the shared opening and published it.
        peer = ChainSketch(runtime.key_rules.chain)
        learning = dataclasses.replace(runtime.key_rules, sketch=peer, learn=True)
        for conversation in range(40):
            _label(turn_body(conversation, 1), learning)
        assert peer.common_count > 0
        client = bounded_client(server.url, 2.0, 2)
        try:
            assert await ChainSync(client, "fleet", peer).round()
        finally:
            await client.aclose()
        # What a peer and an empty sketch say about conversations nobody has seen yet.
        warm = dataclasses.replace(runtime.key_rules, sketch=peer, learn=False)
        cold = dataclasses.replace(runtime.key_rules, sketch=ChainSketch(), learn=False)
        fresh = [turn_body(conversation, 1) for conversation in range(1000, 1020)]
        assert all(_label(b, warm) != _label(b, cold) for b in fresh)  # the sketch matters

        proc, port = _serve(tmp_path, config)
        try:
            # The first requests after READY: keyed as the peer keys them.
            assert [_explain_label(port, b) for b in fresh] == [_label(b, warm) for b in fresh]
            assert "chain sketch warmed from redis" in proc.log_text()
        finally:
            proc.stop()
