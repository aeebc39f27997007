"""How ext_proc streams end through a real Envoy (ARCHITECTURE.md, "End of a stream").

processor.envoy_graceful_close (the default): the rendered bootstrap turns on Envoy's
ext_proc_graceful_grpc_close; Envoy half-closes each stream and waits for the processor, which
answers with OK at once. No stream ends in a reset, so no cancellation reaches grpc.aio (whose
status-on-a-reset-call leaks memory, grpc/grpc#43360) and none pays its cancellation path.
With it false (an Envoy without the flag), Envoy resets every stream behind its half-close
and the processor lingers for that reset (ENVOY_RESET_LINGER_S) instead of answering with a
status: streams end cancelled, and every request is still answered. The linger is a bound: on a
starved machine a reset can reach the processor's loop after it, and that stream has already
ended with a status (the leak path, for that stream only). A processor that does not linger, or
that believes Envoy closes gracefully, ends every stream with a status and none is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from extproc.harness.launch import Client, FleetStack, http_get, wait_until

pytestmark = pytest.mark.timeout(240)

REQUESTS = 40
EXT_PROC = "http.ingress.ext_proc"


def _chat(i: int) -> bytes:
    return orjson.dumps(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"hi {i}"}]}
    )


def _cancelled(stack: FleetStack) -> float:
    return stack.processor_metrics().get(("fleet_extproc_streams_cancelled_total", ()), 0.0)


def _read(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check`` for wait_until, False while an admin read times out (a starved machine)."""

    def checked() -> bool:
        try:
            return check()
        except OSError:
            return False

    return checked


def _run(stack: FleetStack) -> tuple[int, float]:
    """REQUESTS chat requests, each with its own session; (ext_proc streams Envoy started for
    them, processor streams cancelled meanwhile), read once Envoy closed every stream."""
    started = stack.envoy_stat(f"{EXT_PROC}.streams_started")
    cancelled = _cancelled(stack)
    client = Client(stack.listener_port)
    try:
        for i in range(REQUESTS):
            status, _headers, body = client.post_json(
                "/v1/chat/completions", _chat(i), {"x-session-id": f"graceful-{i}"}
            )
            assert status == 200, body[:300]
    finally:
        client.close()
    wait_until(
        _read(
            lambda: (
                stack.envoy_stat(f"{EXT_PROC}.streams_closed")
                == stack.envoy_stat(f"{EXT_PROC}.streams_started")
            )
        ),
        60,
        "Envoy to close every ext_proc stream",
    )
    wait_until(
        _read(
            lambda: stack.processor_metrics().get(("fleet_extproc_streams_active", ()), 1.0) == 0.0
        ),
        60,
        "the processor to end every stream",
    )
    return stack.envoy_stat(f"{EXT_PROC}.streams_started") - started, _cancelled(stack) - cancelled


def _runtime_flag(stack: FleetStack) -> str | None:
    _status, body = http_get(stack.admin_port, "/runtime")
    entry = orjson.loads(body)["entries"].get(
        "envoy.reloadable_features.ext_proc_graceful_grpc_close"
    )
    return None if entry is None else str(entry["final_value"])


def test_a_graceful_envoy_never_resets_a_finished_stream(tmp_path: object) -> None:
    with FleetStack(tmp_path, clusters=2) as stack:  # type: ignore[arg-type]
        assert _runtime_flag(stack) == "true"
        streams, cancelled = _run(stack)
        assert streams >= REQUESTS
        assert cancelled == 0, f"{cancelled} of {streams} streams ended in a reset"
        assert stack.envoy_stat(f"{EXT_PROC}.streams_failed") == 0


def test_without_the_flag_envoy_resets_every_stream_and_the_processor_waits_for_it(
    tmp_path: object,
) -> None:
    overrides = {"processor": {"envoy_graceful_close": False}}
    with FleetStack(tmp_path, clusters=2, fleet_overrides=overrides) as stack:  # type: ignore[arg-type]
        assert _runtime_flag(stack) is None
        streams, cancelled = _run(stack)
        assert streams >= REQUESTS
        # The processor lingered for Envoy's reset rather than sending a status at the
        # half-close: resets end streams. How many arrive within the linger depends on how
        # starved the processor's loop is, so the count is bounded, not exact: without the
        # linger none is cancelled.
        assert 0 < cancelled <= streams, f"{cancelled} of {streams} streams were reset"
        assert stack.envoy_stat(f"{EXT_PROC}.streams_failed") == 0
