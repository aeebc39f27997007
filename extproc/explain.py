"""`extproc explain`: the facts, class, placement and budget behind one decision.

Offline (CLI) it shows what a processor with this config would decide; through a running
processor's admin endpoint (POST /explain on the metrics port) it adds live budget usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from extproc.config import ConfigError, Runtime, load_runtime
from extproc.core.api import BadRequest
from extproc.core.facts import parse_request


def explain_request(
    runtime: Runtime, path: str, headers: dict[str, str], body: bytes
) -> dict[str, object]:
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in headers.items()}}
    facts = parse_request(path, headers, body, runtime.key_rules, runtime.parse_limits)
    if isinstance(facts, BadRequest):
        return {
            "config_version": runtime.version,
            "outcome": "bad_request",
            "status": facts.status,
            "message": facts.message,
        }
    route = runtime.policy.route(facts)
    cls = route.request_class
    placer = runtime.policy.placers[cls.name]
    budget = cls.budget
    return {
        "config_version": runtime.version,
        "outcome": "route",
        "facts": {
            "api": facts.api.value,
            "model": facts.model,
            "session": facts.session.label,
            "session_source": facts.session.source.value,
            "input_tokens_estimate": facts.input_tokens,
            "max_output_tokens": facts.max_output_tokens,
            "tier": facts.tier,
            "stream": facts.stream,
            "body_bytes": facts.body_bytes,
        },
        "class": cls.name,
        "primary": route.placement.primary,
        "secondary": route.placement.secondary,
        "x-fleet-route": route.placement.route,
        "preference_order": placer.ranked(facts.session.point),
        "budget_per_cluster": {
            "max_inflight_tokens": budget.max_inflight_tokens,
            "max_concurrent": budget.max_concurrent,
            "tokens_per_second": budget.tokens_per_second,
            "burst_tokens": budget.burst_tokens,
            "enforced": budget.enforced,
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path to fleet.yaml")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--session", help="a session id, as sent in the session header")
    what.add_argument("--body", help="a request body file (JSON), as a client would send it")
    parser.add_argument("--path", default="/v1/chat/completions", help="the request path")
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="request header"
    )


def run(args: argparse.Namespace) -> int:
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
        header = runtime.config.session.header or "x-session-id"
        headers[header] = args.session
        body = orjson.dumps({"model": "explain", "messages": [{"role": "user", "content": ""}]})
    else:
        body = Path(args.body).read_bytes()
    result = explain_request(runtime, args.path, headers, body)
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if result["outcome"] == "route" else 1
