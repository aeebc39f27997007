"""Session labels are keyed: HMAC-SHA256 of the session digest under the fleet's label secret.

Placement must not depend on the secret (replicas with different secrets still route every
session identically); labels must not be recomputable from a guessed raw id without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.config import ConfigError, compile_runtime, load_runtime, parse_config
from extproc.config import label_secret as label_secret_module
from extproc.core.api import Api
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules, KeySource, SessionKey, derive_session_key, hash_key

JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "user": "bob@example.com"}


def config(**session: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:{9000 + i}"]} for i in range(4)],
        "session": session,
    }


def unkeyed_guess(source: KeySource, raw: str) -> set[str]:
    """Every label an attacker could compute from a guessed raw id without the secret."""
    key = hash_key(source, raw.encode())
    return {
        key.digest[:8].hex(),  # the old, unkeyed label
        key.label,  # HMAC under the empty key
        hashlib.sha256(raw.encode()).hexdigest()[:16],
        hashlib.blake2b(raw.encode(), digest_size=8).hexdigest(),
    }


def facts_of(rules: KeyRules, body: dict[str, Any], headers: dict[str, str]) -> RequestFacts:
    facts = parse_request(CHAT, {**JSON, **headers}, orjson.dumps(body), rules, ParseLimits())
    assert isinstance(facts, RequestFacts), facts
    return facts


@pytest.mark.parametrize(
    ("headers", "source", "raw"),
    [
        ({"x-session-id": "alice@example.com"}, KeySource.HEADER, "alice@example.com"),
        ({}, KeySource.BODY, "bob@example.com"),
    ],
)
def test_label_is_an_hmac_of_the_digest_and_not_an_unkeyed_hash(
    headers: dict[str, str], source: KeySource, raw: str
) -> None:
    secret = b"fleet-secret-for-tests"
    facts = facts_of(KeyRules(label_secret=secret), BODY, headers)
    assert facts.session.source is source
    expected = hmac.new(secret, facts.session.digest, "sha256").hexdigest()[:16]
    assert facts.session.label == expected
    assert facts.session.label not in unkeyed_guess(source, raw)


def test_placement_input_does_not_depend_on_the_secret() -> None:
    a = derive_session_key(Api.OPENAI_CHAT, {}, BODY, KeyRules(label_secret=b"replica-a"))
    b = derive_session_key(Api.OPENAI_CHAT, {}, BODY, KeyRules(label_secret=b"replica-b"))
    assert isinstance(a, SessionKey) and isinstance(b, SessionKey)
    assert a.digest == b.digest and a.point == b.point
    assert a.label != b.label


def test_the_secret_is_not_in_the_rules_repr() -> None:
    assert "s3cr3t" not in repr(KeyRules(label_secret=b"s3cr3t"))


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_SESSION_SECRET", "from-env")
    runtime = compile_runtime(parse_config(config()))
    assert runtime.key_rules.label_secret == b"from-env"
    assert runtime.label_secret_source == "env"


def test_a_configured_env_name_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_LABEL_KEY", "custom")
    monkeypatch.setenv("FLEET_SESSION_SECRET", "default-name")
    runtime = compile_runtime(parse_config(config(label_secret_env="MY_LABEL_KEY")))
    assert runtime.key_rules.label_secret == b"custom"


def test_secret_file_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_SESSION_SECRET", "from-env")
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    runtime = compile_runtime(parse_config(config(label_secret_file=str(path))))
    assert runtime.key_rules.label_secret == b"from-file"
    assert runtime.label_secret_source == "file"


def test_an_unreadable_or_empty_secret_file_is_a_config_error(tmp_path: Path) -> None:
    cfg_path = tmp_path / "fleet.yaml"
    cfg_path.write_text(yaml.safe_dump(config(label_secret_file=str(tmp_path / "missing"))))
    with pytest.raises(ConfigError, match=re.escape("session.label_secret_file")):
        load_runtime(cfg_path)
    (tmp_path / "empty").write_text("  \n")
    cfg_path.write_text(yaml.safe_dump(config(label_secret_file=str(tmp_path / "empty"))))
    with pytest.raises(ConfigError, match="is empty"):
        load_runtime(cfg_path)


def test_without_a_secret_one_random_secret_per_process_survives_reloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLEET_SESSION_SECRET", raising=False)
    monkeypatch.setattr(label_secret_module, "_process_secret", None)
    first = compile_runtime(parse_config(config()))
    again = compile_runtime(parse_config(config()))  # a reload
    assert first.label_secret_source == "process"
    assert len(first.key_rules.label_secret) == 32
    assert first.key_rules.label_secret == again.key_rules.label_secret
    # Another process draws another secret (simulated by forgetting this one's).
    monkeypatch.setattr(label_secret_module, "_process_secret", None)
    other = compile_runtime(parse_config(config()))
    assert other.key_rules.label_secret != first.key_rules.label_secret
    facts_a = facts_of(first.key_rules, BODY, {})
    facts_b = facts_of(other.key_rules, BODY, {})
    assert facts_a.session.label != facts_b.session.label
    # ... while placement stays identical.
    route_a = first.policy.route(facts_a)
    route_b = other.policy.route(facts_b)
    assert route_a.placement == route_b.placement


def test_the_per_process_secret_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    secret = label_secret_module.LabelSecret(b"x" * 32, "process")
    with caplog.at_level("WARNING", logger="extproc.config"):
        label_secret_module.warn_if_per_process(secret, "FLEET_SESSION_SECRET")
    assert "FLEET_SESSION_SECRET" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="extproc.config"):
        label_secret_module.warn_if_per_process(
            label_secret_module.LabelSecret(b"k", "env"), "FLEET_SESSION_SECRET"
        )
    assert caplog.text == ""
