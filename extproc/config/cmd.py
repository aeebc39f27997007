"""``extproc config``: the fleet.yaml schema, a file's check, and the generated reference."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from extproc.config.load import ConfigError, load_runtime
from extproc.config.reference import reference_markdown, schema_text
from extproc.config.summary import summary_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    schema = sub.add_parser("schema", help="print the JSON Schema of fleet.yaml")
    schema.add_argument("-o", "--output", help="write to this file instead of stdout")
    check = sub.add_parser("check", help="validate a fleet.yaml and print what it compiles to")
    check.add_argument("file", help="the fleet.yaml to check")
    check.add_argument(
        "--json", action="store_true", help="print the full config with every default filled in"
    )
    ref = sub.add_parser("reference", help="print the Markdown configuration reference")
    ref.add_argument("-o", "--output", help="write to this file instead of stdout")


def _emit(text: str, output: str | None) -> int:
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _check(path: str, as_json: bool) -> int:
    try:
        runtime = load_runtime(path)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(runtime.config.model_dump(mode="json"), indent=2))
    else:
        print("\n".join(summary_lines(path, runtime)))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "schema":
        return _emit(schema_text(), args.output)
    if args.action == "reference":
        return _emit(reference_markdown(), args.output)
    return _check(args.file, args.json)
