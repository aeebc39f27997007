"""`extproc bench deps`: the measurements behind the README's dependency table, rerun here.

Installs the alternatives into a throw-away virtualenv (they are not project dependencies) and
measures, side by side in one run on this machine:

- parsing an ext_proc ProcessingRequest carrying a 5 KB body, and serialising the body-phase
  ProcessingResponse the processor sends (five header mutations), with ``xds-protos``
  (protobuf, upb) vs ``envoy-data-plane`` (betterproto2);
- whether ``aioredis`` imports on this Python at all.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

MEASURE = r"""
import sys, timeit, json
body = b"x" * 5000
out = {}
KEYS = ("x-fleet-route", "x-fleet-primary", "x-fleet-secondary", "x-fleet-class",
        "x-fleet-session")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.config.core.v3 import base_pb2
req = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
wire = req.SerializeToString()
def upb_parse():
    ep.ProcessingRequest.FromString(wire)
def upb_build():
    cr = ep.CommonResponse(clear_route_cache=True)
    for k in KEYS:
        cr.header_mutation.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=b"c1__c2")))
    ep.ProcessingResponse(request_body=ep.BodyResponse(response=cr)).SerializeToString()

import envoy_data_plane.envoy.service.ext_proc.v3 as bp
import envoy_data_plane.envoy.config.core.v3 as bcore
def bp_parse():
    bp.ProcessingRequest.parse(wire)
def bp_build():
    sets = [bcore.HeaderValueOption(header=bcore.HeaderValue(key=k, raw_value=b"c1__c2"))
            for k in KEYS]
    mutation = bp.HeaderMutation(set_headers=sets)
    cr = bp.CommonResponse(clear_route_cache=True, header_mutation=mutation)
    bytes(bp.ProcessingResponse(request_body=bp.BodyResponse(response=cr)))

def best(fn, n):
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
out["xds-protos parse us"] = best(upb_parse, 20000)
out["envoy-data-plane parse us"] = best(bp_parse, 500)
out["xds-protos build+serialize us"] = best(upb_build, 20000)
out["envoy-data-plane build+serialize us"] = best(bp_build, 500)
try:
    import aioredis  # noqa: F401
    out["aioredis import"] = "ok"
except Exception as exc:
    out["aioredis import"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", help="build the throw-away venv here and keep it")


def run(args: argparse.Namespace) -> int:
    import orjson

    with tempfile.TemporaryDirectory(prefix="bench-deps-") as tmp:
        where = Path(args.keep or tmp)
        venv.create(where, with_pip=True)
        py = str(where / "bin" / "python")
        print(
            f"installing xds-protos, envoy-data-plane, aioredis into {where} ...", file=sys.stderr
        )
        subprocess.run(
            [py, "-m", "pip", "install", "-q", "xds-protos", "envoy-data-plane", "aioredis"],
            check=True,
        )
        out = subprocess.run([py, "-c", MEASURE], check=True, capture_output=True, text=True)
        result = orjson.loads(out.stdout)
        versions = subprocess.run(
            [py, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True, text=True
        ).stdout
    wanted = (
        "xds-protos",
        "envoy_data_plane",
        "envoy-data-plane",
        "betterproto2",
        "protobuf",
        "aioredis",
    )
    print("versions: " + ", ".join(v for v in versions.split() if v.lower().startswith(wanted)))
    print(f"python: {sys.version.split()[0]}")
    print("| operation (5 KB body) | xds-protos (upb) | envoy-data-plane (betterproto2) | ratio |")
    print("|---|---|---|---|")
    for op, a, b in (
        ("parse ProcessingRequest", "xds-protos parse us", "envoy-data-plane parse us"),
        (
            "build + serialize body response",
            "xds-protos build+serialize us",
            "envoy-data-plane build+serialize us",
        ),
    ):
        print(f"| {op} | {result[a]:.2f} µs | {result[b]:.1f} µs | {result[b] / result[a]:.0f}x |")
    print(f"aioredis import on this Python: {result['aioredis import']}")
    return 0
