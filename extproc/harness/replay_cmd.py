"""``extproc replay``: open-loop replay of a Mooncake trace or the synthetic workload."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from extproc.harness.layouts import LAYOUTS, add_layout_arguments, layout_from_args
from extproc.harness.prompts import ApiKind
from extproc.harness.replay import (
    ClassBounds,
    ReplayOptions,
    ReplayResult,
    format_table,
    plot_report,
    run_replay,
    write_json,
)
from extproc.harness.trace import ideal_hit_ratio, read_trace, trace_to_requests
from extproc.harness.workload import BurstSpec, ReplayRequest, WorkloadConfig, generate_workload

_TRACE_APIS: dict[str, ApiKind] = {
    "chat": "openai-chat",
    "completions": "openai-completions",
    "messages": "anthropic-messages",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace")
    source.add_argument("--workload", choices=["synthetic"], help="built-in synthetic workload")
    source.add_argument(
        "--layout",
        choices=LAYOUTS,
        help="conversations sharing one opening placed in this position (extproc.harness.layouts)",
    )
    parser.add_argument("--target", default="http://127.0.0.1:10000", help="base URL (Envoy)")
    parser.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="stop sending after N s")
    parser.add_argument(
        "--concurrency", type=int, default=1024, help="in-flight cap; held requests are counted"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per-attempt timeout (s)")
    parser.add_argument("--retry-429", action="store_true", help="honour retry-after on 429")
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--class-bounds", default="2048,100000", help="SHORT,LONG input tokens")
    parser.add_argument(
        "--session-share", type=float, default=0.5, help="share of sessions sending x-session-id"
    )
    parser.add_argument("--session-header", default="x-session-id")
    parser.add_argument("--model", default="sim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", metavar="FILE")
    parser.add_argument("--png-out", metavar="FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    trace = parser.add_argument_group("trace replay")
    trace.add_argument("--api", choices=sorted(_TRACE_APIS), default="chat")
    trace.add_argument("--no-stream", action="store_true", help="send non-streaming requests")

    add_layout_arguments(parser)

    synthetic = parser.add_argument_group("synthetic workload")
    synthetic.add_argument("--workload-duration", type=float, default=60.0)
    synthetic.add_argument("--chat-rate", type=float, default=1.0, help="chat sessions per s")
    synthetic.add_argument("--rag-rate", type=float, default=0.5, help="RAG requests per s")
    synthetic.add_argument("--agent-rate", type=float, default=0.02, help="agent sessions per s")
    synthetic.add_argument("--agent-max-context", type=int, default=1_000_000)
    synthetic.add_argument("--agent-step-tokens", type=int, default=4000)
    synthetic.add_argument("--stream-share", type=float, default=1.0)
    synthetic.add_argument(
        "--burst",
        action="append",
        default=[],
        metavar="START,DURATION,RATE,TOKENS",
        help="long-context burst (repeatable), e.g. 20,10,2,150000",
    )


def _requests(
    args: argparse.Namespace,
) -> tuple[list[ReplayRequest], tuple[tuple[float, float], ...]]:
    if args.layout is not None:
        return layout_from_args(args), ()
    if args.trace is not None:
        trace = read_trace(args.trace)
        for issue in trace.issues[:20]:
            print(f"{args.trace}:{issue.line}: skipped: {issue.reason}", file=sys.stderr)
        if len(trace.issues) > 20:
            print(f"... {len(trace.issues) - 20} more malformed lines", file=sys.stderr)
        print(
            f"trace: {len(trace.requests)} requests, {len(trace.issues)} skipped lines, "
            f"ideal hit ratio (one infinite cache) {ideal_hit_ratio(trace.requests):.3f}",
            file=sys.stderr,
        )
        requests = trace_to_requests(
            trace,
            api=_TRACE_APIS[args.api],
            model=args.model,
            session_header_share=args.session_share,
            stream=not args.no_stream,
            seed=args.seed,
        )
        return requests, ()
    config = WorkloadConfig(
        seed=args.seed,
        duration_s=args.workload_duration,
        model=args.model,
        chat_sessions_per_s=args.chat_rate,
        rag_per_s=args.rag_rate,
        agent_sessions_per_s=args.agent_rate,
        agent_max_context_tokens=args.agent_max_context,
        agent_step_tokens=args.agent_step_tokens,
        stream_share=args.stream_share,
        session_header_share=args.session_share,
        bursts=tuple(BurstSpec.parse(text) for text in args.burst),
    )
    return generate_workload(config), config.burst_windows


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(main: Coroutine[Any, Any, ReplayResult]) -> ReplayResult:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    try:
        requests, windows = _requests(args)
        options = ReplayOptions(
            speedup=args.speedup,
            max_requests=args.max_requests,
            duration_s=args.duration,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            retry_429=args.retry_429,
            max_retries=args.max_retries,
            class_bounds=ClassBounds.parse(args.class_bounds),
            burst_windows=windows,
            session_header=args.session_header,
            progress=None if args.quiet else _progress,
        )
    except (OSError, ValueError) as exc:
        print(f"extproc replay: {exc}", file=sys.stderr)
        return 2
    result = _run(run_replay(requests, args.target, options))
    print(format_table(result))
    if args.json_out:
        write_json(result, args.json_out)
    if args.png_out:
        plot_report(result, args.png_out)
    ok = result.summary()["all"]["outcomes"]["2xx"]
    return 0 if ok or not result.outcomes else 1
