"""The response headers of a reject (429 / 413 / 503), in the forms clients and SDKs read.

Pure: the wall-clock instant that Anthropic's RFC 3339 resets need is passed in.

What the official Python SDKs do with an error response (openai 3.57 and anthropic 2.14, the
pinned versions, ``_base_client.py``): both read ``retry-after-ms`` first, then ``retry-after``
(seconds, or an HTTP date); ``x-should-retry: true|false``, when present, decides whether to
retry at all; otherwise 408, 409, 429 and >= 500 are retried, twice by default.

- openai waits the hint when 0 < hint <= 120 s; above 120 s it does not retry at all. Releases
  before 2.52 ignored hints above 60 s and used their own 0.5-8 s backoff instead.
- anthropic waits any positive hint, however long.

So a wait of up to :data:`SDK_MAX_RETRY_AFTER_S` (60 s, honoured by every release of both) is
sent as a plain hint and the SDK sleeps it and retries by itself. A longer wait (the long
class on a busy cluster) would be ignored by older openai releases (two quick retries, each
refused again) and slept blindly by anthropic; instead the reject carries
``x-should-retry: false``: the SDK raises the 429 at once, the body message and the headers
carry the real wait (``retry-after``, ``retry-after-ms``, ``x-fleet-retry-after-ms``), and the
caller backs off deliberately.

Headers, all lower-case (HTTP/2 and Envoy want them so):

- ``retry-after`` (whole seconds) and ``retry-after-ms``;
- OpenAI's ``x-ratelimit-{limit,remaining,reset}-tokens`` (resets as Go durations, "6m0s");
- the IETF draft's ``RateLimit-Policy`` / ``RateLimit`` fields;
- on Anthropic-API requests, ``anthropic-ratelimit-{requests,tokens,input-tokens}-{limit,
  remaining,reset}`` with ``-reset`` in RFC 3339. Budgets count estimated input tokens, so the
  tokens and input-tokens families carry the same binding token quota; requests carry the
  concurrency cap (Anthropic's is per minute, ours is in flight: same shape, stricter meaning).
  Output tokens are not budgeted, so there is no output-tokens family.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from extproc.core.admission import Quota, Reject
from extproc.core.api import ErrorStyle

# The longest hint every supported SDK release waits and then retries by itself.
SDK_MAX_RETRY_AFTER_S = 60
# Beside retry-after for callers that turned SDK retries off: the wait in milliseconds, also
# present when x-should-retry is false (where retry-after-ms is too, for SDK error handlers).
FLEET_RETRY_AFTER_MS = "x-fleet-retry-after-ms"


def format_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* style (Go durations): "20ms", "1s", "1m30s", "6m0s"."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rfc3339(epoch_s: float) -> str:
    """Anthropic's reset format: UTC, whole seconds rounded up, "2026-11-30T09:41:07Z"."""
    return datetime.fromtimestamp(math.ceil(epoch_s), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _policy_item(q: Quota) -> str:
    # draft-ietf-httpapi-ratelimit-headers-11 §3: a List of sf-string Items with q (Integer),
    # optional qu (a String from its quota-unit registry: requests, content-bytes,
    # concurrent-requests) and w (Integer seconds). Tokens are not a registered unit, so they
    # travel in a vendor-prefixed parameter, which §3.1 allows.
    item = f'"{q.name}";q={q.quota}'
    item += ';fleet-unit="tokens"' if q.unit == "tokens" else f';qu="{q.unit}"'
    if q.window_s is not None:
        item += f";w={q.window_s}"
    return item


def _limit_item(q: Quota) -> str:
    # §4: r = available quota (Integer ≥ 0), t = effective window in seconds (Integer ≥ 0).
    item = f'"{q.name}";r={q.remaining}'
    if q.reset_s is not None:
        item += f";t={q.reset_s}"
    return item


def sdk_retry_headers(retry_after_s: int) -> list[tuple[str, str]]:
    """retry-after / retry-after-ms, plus x-should-retry: false when the wait is too long for
    an SDK to sleep through by itself (see the module docstring)."""
    ms = str(retry_after_s * 1000)
    headers = [("retry-after", str(retry_after_s)), ("retry-after-ms", ms)]
    if retry_after_s > SDK_MAX_RETRY_AFTER_S:
        headers += [("x-should-retry", "false"), (FLEET_RETRY_AFTER_MS, ms)]
    return headers


def _binding(quotas: tuple[Quota, ...], unit: str) -> Quota | None:
    """Of the quotas in ``unit``, the one with the least room (ties: the later reset)."""
    found = [q for q in quotas if q.unit == unit]
    if not found:
        return None
    return min(found, key=lambda q: (q.remaining, -(q.reset_s or 0)))


def anthropic_headers(reject: Reject, wall_now: float) -> list[tuple[str, str]]:
    """``anthropic-ratelimit-*`` for an Anthropic-API reject; ``wall_now`` is Unix time."""
    headers: list[tuple[str, str]] = []
    families = (
        (("tokens", "input-tokens"), _binding(reject.quotas, "tokens")),
        (("requests",), _binding(reject.quotas, "concurrent-requests")),
    )
    for names, quota in families:
        if quota is None:
            continue
        for name in names:
            prefix = f"anthropic-ratelimit-{name}"
            headers.append((f"{prefix}-limit", str(quota.quota)))
            headers.append((f"{prefix}-remaining", str(quota.remaining)))
            if quota.reset_s is not None:
                headers.append((f"{prefix}-reset", rfc3339(wall_now + quota.reset_s)))
    return headers


def rate_limit_headers(
    reject: Reject, style: ErrorStyle = ErrorStyle.OPENAI, wall_now: float | None = None
) -> list[tuple[str, str]]:
    """Response headers for a reject. Anthropic's headers need ``wall_now`` (Unix time)."""
    headers: list[tuple[str, str]] = [("x-fleet-class", reject.class_name)]
    if reject.retry_after_s is not None:
        headers += sdk_retry_headers(reject.retry_after_s)
    if reject.limit_tokens is not None:
        headers.append(("x-ratelimit-limit-tokens", str(reject.limit_tokens)))
    if reject.remaining_tokens is not None:
        headers.append(("x-ratelimit-remaining-tokens", str(reject.remaining_tokens)))
    if reject.reset_s is not None:
        headers.append(("x-ratelimit-reset-tokens", format_duration(reject.reset_s)))
    if reject.quotas:
        headers.append(("ratelimit-policy", ", ".join(_policy_item(q) for q in reject.quotas)))
        if reject.status == 429:
            headers.append(("ratelimit", ", ".join(_limit_item(q) for q in reject.quotas)))
    if style is ErrorStyle.ANTHROPIC and wall_now is not None:
        headers += anthropic_headers(reject, wall_now)
    return headers
