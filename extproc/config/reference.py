"""fleet.yaml's JSON Schema and its Markdown reference, both from the pydantic schema.

One source (``extproc.config.schema``'s field descriptions), two renderings: the JSON Schema an
editor validates and completes against (``docs/fleet.schema.json``) and the page a reader
reads (``docs/configuration.md``). Tests compare both files with what this module renders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from extproc.config.schema import FleetConfig

SCHEMA_FILE = "docs/fleet.schema.json"
REFERENCE_FILE = "docs/configuration.md"
GENERATED_BY = "extproc config reference -o docs/configuration.md"

Node = Mapping[str, Any]


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of fleet.yaml, field descriptions included."""
    schema = FleetConfig.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "fleet.yaml",
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def _resolve(node: Node, defs: Mapping[str, Node]) -> Node:
    ref = node.get("$ref")
    if isinstance(ref, str):
        return defs[ref.rsplit("/", 1)[-1]]
    return node


def _type_of(node: Node, defs: Mapping[str, Node]) -> str:
    if "$ref" in node:
        return "object"
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return " | ".join(_type_of(sub, defs) for sub in node[key])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type_of(node.get('items', {}), defs)}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type_of(node['additionalProperties'], defs)}"
    return str(kind or "any")


def _bounds(node: Node) -> str:
    parts = []
    for key, sign in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minItems", "items >="),
        ("maxLength", "length <="),
    ):
        if key in node:
            parts.append(f"{sign} {node[key]}")
    for sub in node.get("anyOf", ()):
        parts.extend(b for b in [_bounds(sub)] if b)
    return ", ".join(parts)


def _default(node: Node, required: bool) -> str:
    if required:
        return "required"
    if "default" not in node:
        return "see description"
    value = node["default"]
    if isinstance(value, dict) and value:
        return "see below"
    if isinstance(value, list) and len(json.dumps(value)) > 120:
        return "see description"
    return f"`{json.dumps(value)}`"


def _object_of(node: Node, defs: Mapping[str, Node]) -> tuple[Node, str] | None:
    """The object schema a field holds and the path suffix that reaches it: directly, as list
    items (``[]``), as map values (``.<name>``) or as one branch of a union."""
    if "$ref" in node:
        return _resolve(node, defs), ""
    items = node.get("items")
    if isinstance(items, Mapping):
        found = _object_of(items, defs)
        return (found[0], "[]" + found[1]) if found else None
    values = node.get("additionalProperties")
    if isinstance(values, Mapping):
        found = _object_of(values, defs)
        return (found[0], ".<name>" + found[1]) if found else None
    for branch in node.get("anyOf", ()):
        found = _object_of(branch, defs)
        if found:
            return found
    return None


def _sections(
    path: str, obj: Node, defs: Mapping[str, Node], seen: set[str]
) -> Iterator[tuple[str, Node]]:
    yield path, obj
    for name, field in obj.get("properties", {}).items():
        found = _object_of(field, defs)
        if found is None:
            continue
        inner, suffix = found
        child = f"{path}.{name}{suffix}" if path else f"{name}{suffix}"
        if child in seen:
            continue
        seen.add(child)
        yield from _sections(child, inner, defs, seen)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(path: str) -> str:
    """GitHub's anchor of the heading that shows ``path`` in backticks."""
    return re.sub(r"[^a-z0-9 _-]", "", path.lower()).replace(" ", "-")


def _table(path: str, obj: Node, defs: Mapping[str, Node]) -> list[str]:
    required = set(obj.get("required", ()))
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for name, field in obj.get("properties", {}).items():
        kind = _type_of(field, defs)
        found = _object_of(field, defs)
        if found is not None:
            child = f"{path}.{name}{found[1]}" if path else f"{name}{found[1]}"
            kind = kind.replace("object", f"[object](#{_anchor(child)})", 1)
        bounds = _bounds(field)
        if bounds:
            kind += f" ({bounds})"
        rows.append(
            f"| `{name}` | {_cell(kind)} | {_cell(_default(field, name in required))} "
            f"| {_cell(str(field.get('description', '')))} |"
        )
    return rows


def reference_markdown() -> str:
    """docs/configuration.md: every field of fleet.yaml, section by section."""
    schema = json_schema()
    defs: Mapping[str, Node] = schema.get("$defs", {})
    lines = [
        "# Configuration reference (`fleet.yaml`)",
        "",
        f"<!-- Generated by `{GENERATED_BY}` from extproc/config/schema.py;"
        " a test fails when it is stale. Do not edit by hand. -->",
        "",
        "Every field of `fleet.yaml`, version 1. Only `version` and `clusters` are required;",
        "everything else has a default. Check a file with `extproc config check fleet.yaml`",
        "(errors name the path of the bad field); print this schema as JSON Schema with",
        "`extproc config schema`. Editors that speak the YAML language server validate and",
        "complete a file whose first line points at the schema shipped in the repository,",
        "[`docs/fleet.schema.json`](fleet.schema.json), by a path relative to the file:",
        "",
        "```yaml",
        "# yaml-language-server: $schema=../docs/fleet.schema.json",
        "```",
        "",
        "Defaults shown as `null` mean unset; where an unset value is derived from other",
        "fields, the description says how.",
    ]
    root: Node = {k: v for k, v in schema.items() if k != "$defs"}
    for path, obj in _sections("", root, defs, set()):
        heading = f"`{path}`" if path else "Top level"
        lines += ["", f"## {heading}", ""]
        if path and obj.get("description"):
            lines += [" ".join(str(obj["description"]).split()), ""]
        lines += _table(path, obj, defs)
    return "\n".join(lines) + "\n"
