"""What a reject tells clients and SDKs: retry hints within what SDKs honour, Anthropic's
rate-limit headers in Anthropic's formats."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from extproc.core.admission import Quota, Reason, Reject
from extproc.core.api import ErrorStyle
from extproc.core.ratelimit_headers import (
    FLEET_RETRY_AFTER_MS,
    SDK_MAX_RETRY_AFTER_S,
    anthropic_headers,
    rate_limit_headers,
    rfc3339,
    sdk_retry_headers,
)

# 2026-11-30T09:00:00Z
NOW = datetime(2026, 11, 30, 9, 0, 0, tzinfo=UTC).timestamp()


def reject(retry_after_s: int | None = 7, status: int = 429) -> Reject:
    return Reject(
        status,
        "short",
        "c1",
        "over budget",
        Reason.INFLIGHT_TOKENS,
        retry_after_s=retry_after_s,
        limit_tokens=20_000,
        remaining_tokens=500,
        reset_s=6.2,
        quotas=(
            Quota("short-inflight", 20_000, "tokens", 500, reset_s=7),
            Quota("short-concurrency", 8, "concurrent-requests", 3),
            Quota("short-rate", 10_000, "tokens", 9_000, window_s=2),
        ),
    )


@pytest.mark.parametrize("seconds", [1, 7, SDK_MAX_RETRY_AFTER_S])
def test_short_waits_are_plain_hints_the_sdks_sleep_through(seconds: int) -> None:
    headers = dict(sdk_retry_headers(seconds))
    assert headers == {"retry-after": str(seconds), "retry-after-ms": str(seconds * 1000)}


@pytest.mark.parametrize("seconds", [SDK_MAX_RETRY_AFTER_S + 1, 121, 300])
def test_long_waits_tell_sdks_not_to_retry_but_still_carry_the_wait(seconds: int) -> None:
    headers = dict(sdk_retry_headers(seconds))
    assert headers["x-should-retry"] == "false"
    assert headers["retry-after"] == str(seconds)
    assert headers["retry-after-ms"] == str(seconds * 1000)
    assert headers[FLEET_RETRY_AFTER_MS] == str(seconds * 1000)


def test_openai_style_has_no_anthropic_headers() -> None:
    headers = dict(rate_limit_headers(reject(), ErrorStyle.OPENAI, NOW))
    assert headers["retry-after"] == "7"
    assert headers["retry-after-ms"] == "7000"
    assert "x-should-retry" not in headers
    assert not [h for h in headers if h.startswith("anthropic-")]


def test_anthropic_headers_use_the_binding_quota_and_rfc3339_resets() -> None:
    headers = dict(rate_limit_headers(reject(), ErrorStyle.ANTHROPIC, NOW))
    # The binding token quota is the one with the least room: inflight (500 left).
    for family in ("tokens", "input-tokens"):
        assert headers[f"anthropic-ratelimit-{family}-limit"] == "20000"
        assert headers[f"anthropic-ratelimit-{family}-remaining"] == "500"
        assert headers[f"anthropic-ratelimit-{family}-reset"] == "2026-11-30T09:00:07Z"
    assert headers["anthropic-ratelimit-requests-limit"] == "8"
    assert headers["anthropic-ratelimit-requests-remaining"] == "3"
    # Concurrency did not refuse this request: no reset instant is known for it.
    assert "anthropic-ratelimit-requests-reset" not in headers
    assert not [h for h in headers if h.startswith("anthropic-ratelimit-output-tokens")]
    # The common headers stay beside them.
    assert headers["retry-after"] == "7"
    assert "ratelimit-policy" in headers


def test_anthropic_resets_parse_as_rfc3339_utc() -> None:
    for _name, value in anthropic_headers(reject(), NOW + 0.4):
        if _name.endswith("-reset"):
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            assert parsed.tzinfo is not None
            # Rounded up to whole seconds, never earlier than the true reset.
            assert parsed.timestamp() >= NOW + 0.4 + 7


def test_anthropic_headers_need_a_wall_clock() -> None:
    headers = dict(rate_limit_headers(reject(), ErrorStyle.ANTHROPIC))
    assert not [h for h in headers if h.startswith("anthropic-")]


def test_rfc3339_rounds_up() -> None:
    assert rfc3339(NOW + 0.001) == "2026-11-30T09:00:01Z"
    assert rfc3339(NOW) == "2026-11-30T09:00:00Z"


def test_413_has_no_retry_hints() -> None:
    headers = dict(rate_limit_headers(reject(None, 413), ErrorStyle.ANTHROPIC, NOW))
    assert "retry-after" not in headers
    assert "retry-after-ms" not in headers
    assert "x-should-retry" not in headers
    assert "ratelimit" not in headers
