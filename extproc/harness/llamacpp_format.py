"""What a simulated cluster exposes when it plays llama.cpp's server (``--engine llamacpp``).

Read from a running ``llama-server`` (the fixtures in ``tests/engines/fixtures/llamacpp``,
recorded with ``extproc engine-fixtures``; ``tests/unit/test_engine_fixtures.py`` compares):

- ``/metrics``: fifteen unlabelled families, printed by the server's own code (not a Prometheus
  library): ``# HELP`` and ``# TYPE`` lines, values in C++'s default stream format (``170``,
  ``0.139706``, ``1216.84``), no ``_created`` series. ``prompt_tokens_total`` counts the prompt
  tokens *evaluated* (cached ones excluded), ``prompt_tokens_cached_total`` the reused ones;
  ``requests_processing`` are the requests in a slot, ``requests_deferred`` those waiting for
  one. There is no KV-use gauge.
- Responses carry ``usage.prompt_tokens_details.cached_tokens`` and, beside ``usage``, a
  ``timings`` object (``cache_n`` reused, ``prompt_n`` evaluated, and their times).
- ``/v1/models`` lists the one model under its alias, ``owned_by: llamacpp``, with a ``meta``
  object, after an Ollama-style ``models`` list.
- A single-model server answers whatever ``model`` a request names (the response names its
  own alias): it never answers 404 for an unknown model.
- Errors: ``{"error": {"code": N, "message": ..., "type": ...}}``, e.g.
  ``invalid_request_error``, ``exceed_context_size_error`` (400), ``unavailable_error`` (503
  while the model loads).
- No load header on any response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extproc.harness.kvmodel import LoadSnapshot

OWNED_BY = "llamacpp"
# The build a response names (a server built outside llama.cpp's git tree prints this one).
SYSTEM_FINGERPRINT = "b0-unknown"


@dataclass(slots=True)
class LlamaCppCounters:
    prompt_evaluated: int = 0
    prompt_cached: int = 0
    prompt_seconds: float = 0.0
    predicted: int = 0
    predicted_seconds: float = 0.0
    decode_calls: int = 0
    tokens_max: int = 0
    # Busy slots summed over decode calls (the gauge is their average).
    busy_slot_sum: int = 0


def _number(value: float) -> str:
    """C++'s default ``std::ostream << double`` (6 significant digits, like ``%g``)."""
    return f"{value:g}"


class LlamaCppMetrics:
    """llama.cpp's /metrics page, from counters the simulator keeps as requests play out."""

    def __init__(self, load: Callable[[], LoadSnapshot]) -> None:
        self._load = load
        self.counters = LlamaCppCounters()

    def record(
        self,
        evaluated: int,
        cached: int,
        predicted: int,
        prompt_s: float,
        predicted_s: float,
    ) -> None:
        c = self.counters
        c.prompt_evaluated += evaluated
        c.prompt_cached += cached
        c.prompt_seconds += prompt_s
        c.predicted += predicted
        c.predicted_seconds += predicted_s
        # One decode call for the prompt, one per generated token after the first.
        calls = 1 + max(0, predicted - 1)
        load = self._load()
        c.decode_calls += calls
        c.busy_slot_sum += calls * max(1, load.inflight - load.queued)
        c.tokens_max = max(c.tokens_max, evaluated + cached + predicted)

    def page(self) -> str:
        c = self.counters
        load = self._load()
        families: list[tuple[str, str, str, float]] = [
            ("prompt_tokens_total", "counter",
             "Number of prompt tokens processed, excluding cached tokens", c.prompt_evaluated),
            ("prompt_tokens_cached_total", "counter",
             "Number of prompt tokens reused from the cache", c.prompt_cached),
            ("prompt_seconds_total", "counter",
             "Total time spent processing prompts", c.prompt_seconds),
            ("tokens_predicted_total", "counter",
             "Number of generation tokens processed", c.predicted),
            ("tokens_predicted_seconds_total", "counter",
             "Total time spent generating tokens", c.predicted_seconds),
            ("n_decode_total", "counter",
             "Total number of llama_decode() calls, excluding speculative decoding and"
             " multimodal decoding", c.decode_calls),
            ("n_tokens_max", "counter",
             "Largest observed sequence length (prompt + generation)", c.tokens_max),
            ("spec_decode_num_draft_tokens_total", "counter",
             "Speculative: Total draft tokens generated", 0),
            ("spec_decode_num_accepted_tokens_total", "counter",
             "Speculative: Total draft tokens accepted by the target model", 0),
            ("spec_decode_num_drafts_total", "counter",
             "Speculative: Total speculative decoding verification steps", 0),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
             c.prompt_evaluated / c.prompt_seconds if c.prompt_seconds > 0 else 0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
             c.predicted / c.predicted_seconds if c.predicted_seconds > 0 else 0),
            ("requests_processing", "gauge", "Number of requests processing",
             load.inflight - load.queued),
            ("requests_deferred", "gauge", "Number of requests deferred", load.queued),
            ("n_busy_slots_per_decode", "gauge",
             "Average number of busy slots per llama_decode() call",
             c.busy_slot_sum / c.decode_calls if c.decode_calls else 0),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_text, value in families:
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {_number(value)}",
            ]
        return "\n".join(lines) + "\n"


def timings(
    cached: int, evaluated: int, predicted: int, prompt_s: float, predicted_s: float
) -> dict[str, float | int]:
    """The ``timings`` object llama.cpp puts beside ``usage``."""
    prompt_ms = prompt_s * 1000.0
    predicted_ms = predicted_s * 1000.0
    return {
        "cache_n": cached,
        "prompt_n": evaluated,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
        "prompt_per_second": evaluated / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
        "predicted_per_second": predicted / predicted_s if predicted_s > 0 else 0.0,
    }


def models_body(alias: str, created: int) -> dict[str, object]:
    """``/v1/models`` of a single-model server serving ``alias`` (the shape of the real one;
    ``meta`` holds the model's own numbers, zero here)."""
    meta = {"vocab_type": 2, "n_vocab": 0, "n_ctx": 0, "n_ctx_train": 0, "n_embd": 0,
            "n_params": 0, "size": 0}  # fmt: skip
    ollama = {
        "name": alias, "model": alias, "modified_at": "", "size": "", "digest": "",
        "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
        "parameters": "",
        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                    "parameter_size": "", "quantization_level": ""},
    }  # fmt: skip
    data = {
        "id": alias, "aliases": [alias], "tags": [], "object": "model",
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": created, "owned_by": OWNED_BY, "meta": meta,
    }  # fmt: skip
    return {"models": [ollama], "object": "list", "data": [data]}


def error_body(status: int, message: str) -> dict[str, object]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "unavailable_error"}
    return {"error": {"code": status, "message": message, "type": kind.get(status, "server_error")}}
