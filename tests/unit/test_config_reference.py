"""The configuration reference cannot drift from the schema, and every example config is valid.

- every field of every fleet.yaml section carries a description (what it does, when to change
  it), which is what `extproc config schema` prints and docs/configuration.md renders;
- docs/fleet.schema.json and docs/configuration.md are exactly what the generator prints
  (regenerate: `extproc config schema -o docs/fleet.schema.json` and
  `extproc config reference -o docs/configuration.md`);
- every fleet.yaml shipped as an example validates and points an editor at the schema file;
- every fleet.yaml fragment quoted in a document validates (completed with `version` and a
  cluster when it shows only other sections);
- `extproc config check` prints what a file compiles to, and path-indexed errors for a bad one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from extproc.cli import main
from extproc.config.load import ConfigError, parse_config
from extproc.config.reference import (
    REFERENCE_FILE,
    SCHEMA_FILE,
    json_schema,
    reference_markdown,
    schema_text,
)
from extproc.config.schema import FleetConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIGS = [REPO / "compose" / "fleet.yaml", *sorted((REPO / "docs").rglob("*.yaml"))]
DOCUMENTS = [*sorted(REPO.glob("*.md")), *sorted((REPO / "docs").rglob("*.md"))]
SCHEMA_COMMENT = re.compile(r"^# yaml-language-server: \$schema=(\S+)$", re.MULTILINE)
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        for arg in _flatten(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                _models(arg, seen)


def _flatten(annotation: object) -> list[object]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [x for a in args for x in _flatten(a)]


def test_every_field_of_every_section_has_a_description() -> None:
    models: set[type[BaseModel]] = set()
    _models(FleetConfig, models)
    assert len(models) > 15
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert missing == []


def test_the_shipped_schema_file_is_current() -> None:
    assert (REPO / SCHEMA_FILE).read_text(encoding="utf-8") == schema_text(), (
        "regenerate: extproc config schema -o docs/fleet.schema.json"
    )


def test_the_configuration_reference_is_current() -> None:
    assert (REPO / REFERENCE_FILE).read_text(encoding="utf-8") == reference_markdown(), (
        "regenerate: extproc config reference -o docs/configuration.md"
    )


def test_the_reference_names_every_field() -> None:
    text = reference_markdown()
    models: set[type[BaseModel]] = set()
    _models(FleetConfig, models)
    for model in models:
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name}"


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_config_validates_and_points_at_the_schema(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    parse_config(data, str(path))
    jsonschema.validate(data, json_schema())
    comment = SCHEMA_COMMENT.search(text)
    assert comment, f"{path}: no '# yaml-language-server: $schema=' line"
    assert (path.parent / comment.group(1)).resolve() == (REPO / SCHEMA_FILE).resolve()


def _fleet_fragments() -> list[tuple[str, str]]:
    sections = set(FleetConfig.model_fields)
    found = []
    for doc in DOCUMENTS:
        if doc.name == "configuration.md":
            continue
        for i, block in enumerate(YAML_BLOCK.findall(doc.read_text(encoding="utf-8"))):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data and set(data) <= sections:
                found.append((f"{doc.relative_to(REPO)}#{i}", block))
    return found


FRAGMENTS = _fleet_fragments()


def test_the_documents_quote_fleet_yaml() -> None:
    assert len(FRAGMENTS) >= 3


@pytest.mark.parametrize(("where", "block"), FRAGMENTS, ids=[w for w, _ in FRAGMENTS])
def test_every_fleet_yaml_quoted_in_a_document_validates(where: str, block: str) -> None:
    data = yaml.safe_load(block)
    data.setdefault("version", 1)
    data.setdefault("clusters", [{"name": "c1", "endpoints": ["127.0.0.1:8000"]}])
    parse_config(data, where)
    jsonschema.validate(data, json_schema())


def test_config_check_prints_what_the_file_compiles_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "check", str(REPO / "compose" / "fleet.yaml")]) == 0
    out = capsys.readouterr().out
    assert ": valid, version " in out
    for line in ("data path: route", "clusters (3):", "classes (first match wins):"):
        assert line in out
    assert main(["config", "check", "--json", str(REPO / "compose" / "fleet.yaml")]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["processor"]["read_body"] == "when_needed"  # a default filled in


def test_config_check_names_the_path_of_each_bad_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text(
        "version: 1\nclusters:\n  - {name: c1, endpoints: ['h:1'], weight: 0}\n"
        "classes:\n  - {name: all, eligible: [c9]}\nprocessor: {colour: red}\n"
    )
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "clusters[0].weight: must be > 0" in err
    assert "processor.colour: unknown field" in err
    with pytest.raises(ConfigError):
        parse_config(yaml.safe_load(bad.read_text()), str(bad))


def test_config_schema_and_reference_print_the_generated_text(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()
    out = tmp_path / "configuration.md"
    assert main(["config", "reference", "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == reference_markdown()
