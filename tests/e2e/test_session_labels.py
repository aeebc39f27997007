"""Session labels through a real Envoy: keyed with the fleet secret, placement unaffected by it.

The label the upstream sees (``x-fleet-session``, recorded by Envoy's access log) and the one the
processor logs are HMAC-SHA256 of the session digest under ``FLEET_SESSION_SECRET``: none of
them matches a hash an attacker could compute from a guessed id without the secret. Restarting
the processor with another secret changes every label and no placement.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import orjson
import pytest

from extproc.config import load_runtime
from extproc.core.keys import KeySource, hash_key
from extproc.harness.launch import Client, FleetStack, wait_until
from tests.e2e.predict import PURE_HASH, facts_for

CHAT = "/v1/chat/completions"

# (request id, extra headers, body fields, the raw session id and its source)
CASES: list[tuple[str, dict[str, str], dict[str, object], str, KeySource]] = [
    (
        "lbl-header",
        {"x-session-id": "alice@example.com"},
        {},
        "alice@example.com",
        KeySource.HEADER,
    ),
    ("lbl-user", {}, {"user": "bob@example.com"}, "bob@example.com", KeySource.BODY),
    ("lbl-meta", {}, {"metadata": {"user_id": "100042"}}, "100042", KeySource.BODY),
]


def _body(extra: dict[str, object]) -> bytes:
    messages = [{"role": "user", "content": "label test"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2, **extra})


def _unkeyed(source: KeySource, raw: str) -> set[str]:
    key = hash_key(source, raw.encode())
    return {
        key.digest[:8].hex(),  # the label before keying
        key.label,  # HMAC under an empty key
        hashlib.sha256(raw.encode()).hexdigest()[:16],
        hashlib.blake2b(raw.encode(), digest_size=8).hexdigest(),
    }


def _access_lines(workdir: Path) -> list[dict[str, str]]:
    path = workdir / "access.log"
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _send(stack: FleetStack) -> dict[str, str]:
    """Send every case once, one after the other; return case -> cluster that served it."""
    client = Client(stack.listener_port)
    served = {}
    try:
        for rid, headers, fields, _, _ in CASES:
            status, hdrs, data = client.post_json(CHAT, _body(fields), headers)
            assert status == 200, data
            served[rid] = hdrs["x-served-by"]
    finally:
        client.close()
    return served


def _labels(stack: FleetStack, already: int) -> dict[str, str]:
    """case -> the label Envoy sent upstream (its access log), checked against the processor's
    log line for the same request (joined on Envoy's own x-request-id: the edge does not
    trust a client's)."""
    total = already + len(CASES)
    wait_until(lambda: len(_access_lines(stack.workdir)) >= total, 30, "access log lines")
    entries = _access_lines(stack.workdir)[already:total]  # sequential sends: in order
    log = stack.procs[0].log_text()
    labels = {}
    for (rid, *_), entry in zip(CASES, entries, strict=True):
        upstream_label = entry["session"]
        line = next(ln for ln in log.splitlines() if f'"request_id":"{entry["request_id"]}"' in ln)
        assert orjson.loads(line)["session"] == upstream_label  # logs and upstream agree
        labels[rid] = upstream_label
    return labels


def test_labels_are_keyed_and_placement_ignores_the_secret(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    stack = FleetStack(
        tmp_path_factory.mktemp("labels"),
        clusters=3,
        processor_args=("--log-level", "debug"),
        processor_env={"FLEET_SESSION_SECRET": "secret-a"},
        # Pure hashing predicts first turns (no balance spills): tests session labels.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        runtime = load_runtime(stack.fleet_path)
        served_a = _send(stack)
        labels_a = _labels(stack, 0)
        for rid, headers, fields, raw, source in CASES:
            facts = facts_for(runtime, CHAT, _body(fields), headers)
            assert facts.session.source is source
            keyed = hmac.new(b"secret-a", facts.session.digest, "sha256").hexdigest()[:16]
            assert labels_a[rid] == keyed
            assert labels_a[rid] not in _unkeyed(source, raw)
            assert raw not in stack.procs[0].log_text()
            assert served_a[rid] == runtime.policy.route(facts).placement.primary

        # The same fleet with another secret: other labels, the same clusters.
        stack.procs[0].stop()
        stack.processor_env = {"FLEET_SESSION_SECRET": "secret-b"}
        stack.start_processor(0)
        served_b = _send(stack)
        labels_b = _labels(stack, len(CASES))
        assert served_b == served_a
        for rid, headers, fields, _, _ in CASES:
            digest = facts_for(runtime, CHAT, _body(fields), headers).session.digest
            assert labels_b[rid] == hmac.new(b"secret-b", digest, "sha256").hexdigest()[:16]
            assert labels_b[rid] != labels_a[rid]
