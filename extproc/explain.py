"""`extproc explain`: the facts, class, placement and budget behind one decision.

The decision comes from the pipeline the processor runs (extproc/pipeline/pipeline.py), so it
includes load-aware affinity and endpoint picking. Offline (``--config``) a fresh pipeline with
an in-memory ledger decides, as a processor that has just started would. With ``--admin`` a
running processor previews the decision on its live state (session memory, load reports,
endpoint health) through its admin endpoint (POST /explain on the metrics port), changing
nothing, and adds the live budget usage of the compartment.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, Runtime, load_runtime
from extproc.ledger.gate import build_gate
from extproc.pipeline.explain import explain_outcome, request_headers
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder


async def explain_offline(
    runtime: Runtime, path: str, headers: dict[str, str], body: bytes
) -> dict[str, object]:
    """What a freshly started processor with this config decides: the live decision path, on
    an in-memory ledger and a throwaway metrics registry."""
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(0))
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    try:
        outcome = await pipeline.decide(request_headers(path, headers), body, time.perf_counter())
        result = explain_outcome(runtime, outcome)
        if isinstance(outcome, Routed):
            await pipeline.release(outcome.hold)
        return result
    finally:
        await pipeline.aclose()
        await gate.close()


def explain_remote(
    admin_url: str, path: str, headers: dict[str, str], body: bytes, timeout_s: float = 10.0
) -> dict[str, object]:
    """Ask a running processor's admin endpoint (its live state, changing nothing)."""
    url = f"{admin_url.rstrip('/')}/explain?{urllib.parse.urlencode({'path': path})}"
    req = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json", **headers}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        result: dict[str, object] = orjson.loads(resp.read())
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="path to fleet.yaml (decide offline)")
    where.add_argument(
        "--admin",
        metavar="URL",
        help="a running processor's admin base URL, e.g. http://127.0.0.1:9464 (live state)",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--session", help="a session id, as sent in the session header")
    what.add_argument("--body", help="a request body file (JSON), as a client would send it")
    parser.add_argument("--path", default="/v1/chat/completions", help="the request path")
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="request header"
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    runtime: Runtime | None = None
    if args.config is not None:
        try:
            runtime = load_runtime(args.config)
        except (ConfigError, OSError) as exc:
            print(str(exc), file=sys.stderr)
            return 2
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"--header {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        headers[name.lower()] = value
    if args.session is not None:
        header = (runtime.config.session.header if runtime else None) or "x-session-id"
        headers[header] = args.session
        body = orjson.dumps({"model": "explain", "messages": [{"role": "user", "content": ""}]})
    else:
        body = Path(args.body).read_bytes()
    if runtime is not None:
        result = asyncio.run(explain_offline(runtime, args.path, headers, body))
    else:
        try:
            result = explain_remote(args.admin, args.path, headers, body)
        except (urllib.error.URLError, OSError) as exc:
            print(f"--admin {args.admin}: {exc}", file=sys.stderr)
            return 2
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if result["outcome"] == "route" else 1
