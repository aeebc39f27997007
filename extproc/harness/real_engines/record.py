"""``extproc engine-fixtures``: record what a real engine serves, as test fixtures.

Starts one real llama.cpp server (the tiny random model, 2 slots, ``make engine-deps``) on
127.0.0.1, sends a fixed set of requests and writes, into ``OUT`` (by default the tier's
``tests/engines/fixtures/llamacpp``):

- ``metrics.txt``: its ``/metrics`` page after the requests (Prometheus text);
- ``metrics-busy.txt``: the page while 4 long requests run on its 2 slots (2 deferred);
- ``models.json``: its ``/v1/models``;
- ``chat.json``, ``chat-cached.json``: a chat completion, then the same again (a cache hit);
- ``chat-stream.txt``: a streamed chat completion with ``stream_options.include_usage``;
- ``completion.json``: a text completion;
- ``error-context.json``: its answer to a prompt longer than a slot's context (HTTP 400).

The simulator's ``--engine llamacpp`` is checked against these (tests/unit/test_engine_fixtures).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from extproc.harness.real_engines import llamacpp
from extproc.harness.real_engines.base import ENGINES_DIR, REPO, running

DEFAULT_OUT = REPO / "tests" / "engines" / "fixtures" / "llamacpp"
ALIAS = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory")
    parser.add_argument("--workdir", type=Path, default=ENGINES_DIR / "record")


def _post(url: str, doc: dict[str, object]) -> tuple[int, bytes]:
    data = json.dumps(doc).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        body: bytes = response.read()
        return body


def _chat(text: str, max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "model": ALIAS,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _pretty(raw: bytes) -> str:
    return json.dumps(json.loads(raw), indent=2, sort_keys=True) + "\n"


def _busy_page(engine: llamacpp.LlamaCppEngine) -> str:
    """The /metrics page while 4 long requests share the 2 slots."""
    url = engine.url + "/v1/chat/completions"
    long = _chat("Write a long story.", 400, ignore_eos=True)
    threads = [threading.Thread(target=_post, args=(url, long)) for _ in range(4)]
    for thread in threads:
        thread.start()
    page = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        page = engine.metrics_text()
        if "llamacpp:requests_deferred 2\n" in page:
            break
        time.sleep(0.05)
    for thread in threads:
        thread.join(600)
    return page


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = llamacpp.tiny_model(ENGINES_DIR / "cache")
    spec = llamacpp.LlamaCppSpec(model, ALIAS, n_ctx=4096, slots=2, threads=1, cache_ram_mib=0)
    engine = llamacpp.LlamaCppEngine("record", args.workdir, spec)
    with running([engine], llamacpp.START_TIMEOUT_S):
        chat_url = engine.url + "/v1/chat/completions"
        question = "Name three colours of the rainbow. " * 8
        files: dict[str, str] = {"models.json": _pretty(_get(engine.url + "/v1/models"))}
        files["chat.json"] = _pretty(_post(chat_url, _chat(question, 4))[1])
        files["chat-cached.json"] = _pretty(_post(chat_url, _chat(question, 4))[1])
        stream = _chat(question + "Again.", 3, stream=True, stream_options={"include_usage": True})
        files["chat-stream.txt"] = _post(chat_url, stream)[1].decode()
        completion = {"model": ALIAS, "prompt": "One, two,", "max_tokens": 3, "temperature": 0}
        files["completion.json"] = _pretty(_post(engine.url + "/v1/completions", completion)[1])
        status, body = _post(chat_url, _chat("word " * 3000, 2))
        if status != 400:
            raise SystemExit(f"expected a 400 for an over-long prompt, got {status}")
        files["error-context.json"] = _pretty(body)
        files["metrics.txt"] = engine.metrics_text()
        files["metrics-busy.txt"] = _busy_page(engine)
    for name, text in files.items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    return 0
