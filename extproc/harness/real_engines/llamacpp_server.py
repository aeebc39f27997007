"""Runs one llama.cpp HTTP server (``llama-server``) in this process, through the xllamacpp wheel.

A script for the engine venv's interpreter (``make engine-deps``), started by
``extproc.harness.real_engines.llamacpp``: it imports only the standard library and xllamacpp,
never ``extproc``. Every ``CommonParams`` field set here is a ``llama-server`` flag (given in
the comments). The server listens on 127.0.0.1 only; it prints ``READY host:port`` once the
model is loaded and runs until SIGTERM or SIGKILL.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import xllamacpp


def params(args: argparse.Namespace) -> xllamacpp.CommonParams:
    p = xllamacpp.CommonParams()
    p.model.path = args.model  # -m
    p.model_alias = {args.alias}  # --alias: the name in /v1/models and in responses
    p.hostnames = ["127.0.0.1"]  # --host
    p.port = args.port  # --port
    p.n_ctx = args.n_ctx  # -c: the whole context, divided among the slots
    p.n_parallel = args.slots  # -np
    # --threads-http: llama-server's default is max(slots + 2, cores - 1). Each open request
    # holds one, deferred ones included: beyond that, /health and /metrics wait behind them
    # (Envoy's health check would fail a merely busy engine).
    p.n_threads_http = args.threads_http
    p.cpuparams.n_threads = args.threads  # -t
    p.cpuparams_batch.n_threads = args.threads  # -tb
    p.endpoint_metrics = True  # --metrics
    p.endpoint_slots = True  # --slots
    p.cache_prompt = True  # --cache-prompt (the default): a slot reuses its KV prefix
    p.cache_ram_mib = args.cache_ram_mib  # --cache-ram: host-RAM prompt cache (0: none)
    p.n_predict = -1
    p.warmup = True
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--alias", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--threads-http", type=int, default=-1)
    parser.add_argument("--cache-ram-mib", type=int, default=8192)
    args = parser.parse_args()
    started = time.monotonic()
    server = xllamacpp.Server(params(args))
    print(f"READY {server.listening_address} load_s={time.monotonic() - started:.2f}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
