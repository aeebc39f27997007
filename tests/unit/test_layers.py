"""The package layout holds: no cycles between top-level packages, the serving path imports no
tooling, the decision core does no I/O, and the production install carries no plotting or
numeric libraries. See ARCHITECTURE.md, "Layers".

Imports are read from the source (every ``import`` statement, including those inside functions:
a lazy import still loads its module when it runs).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections import defaultdict
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "extproc"

# What `extproc serve` runs. Everything it imports must stay inside this set (and the stdlib
# and [project.dependencies]).
SERVING = {
    "core",
    "config",
    "ledger",
    "pipeline",
    "protocol",
    "render",
    "serve",
    "names",
    "tracing",
}
# Development and evaluation tools: they may import the serving path, never the reverse.
TOOLING = {"harness", "bench", "sim", "reliability"}
# The decision core is pure: no I/O, no clocks, no protocol, no randomness of its own.
CORE_FORBIDDEN = {
    "asyncio",
    "time",
    "socket",
    "grpc",
    "envoy",
    "redis",
    "aiohttp",
    "prometheus_client",
    "pydantic",
    "yaml",
}
# numpy is pure computation (no I/O, no clock): the core may use it, and only for this: a
# placement miss at hundreds of clusters evaluated as arrays (issue 21).
CORE_NUMPY = {"extproc/core/placement.py"}
# Libraries the production image must not carry (extras only: report, dev). numpy is a
# production dependency since the core's placement uses it (CORE_NUMPY).
HEAVY = {"matplotlib", "pandas", "scipy", "contourpy", "pillow", "kiwisolver"}


def _unit(path: Path) -> str:
    """The top-level package or module of ``extproc`` a file belongs to."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "extproc":
                found.update(f"extproc.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "extproc" and len(parts) > 1 and parts[1] != unit:
                graph[unit][parts[1]].add(str(path.relative_to(REPO)))
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_unit_is_classified() -> None:
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__", "cli", "explain"}
    unknown = units - SERVING - TOOLING
    assert not unknown, f"new top-level units must be placed in SERVING or TOOLING: {unknown}"


def test_no_cycle_between_top_level_packages() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def _tooling_imports(graph: dict[str, dict[str, set[str]]]) -> dict[str, list[str]]:
    return {
        f"{unit} -> {dep}": sorted(files)
        for unit in SERVING
        for dep, files in graph.get(unit, {}).items()
        if dep in TOOLING or dep not in SERVING
    }


def test_the_serving_path_imports_no_tooling() -> None:
    bad = _tooling_imports(_graph())
    assert not bad, bad


def test_the_core_does_no_io() -> None:
    bad: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for name in _imports(path):
            root = name.split(".")[0]
            inside = name.startswith("extproc.core") or name == "extproc.names"
            rel = str(path.relative_to(REPO))
            numeric = root == "numpy" and rel not in CORE_NUMPY
            if root in CORE_FORBIDDEN or (root == "extproc" and not inside) or numeric:
                bad.setdefault(rel, []).append(name)
    assert not bad, bad


# The protocol shell talks to the pipeline through one seam (the per-exchange object and the
# decision union it re-exports) and reads no runtime, no ledger: ARCHITECTURE.md, "Layers".
PROTOCOL_SEAM = "extproc.pipeline.exchange"
PROTOCOL_FORBIDDEN = ("extproc.pipeline", "extproc.config", "extproc.ledger", "extproc.serve")


def _past_the_seam(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for rel, names in imports.items():
        for name in sorted(names):
            if name == PROTOCOL_SEAM:
                continue
            if any(name == f or name.startswith(f + ".") for f in PROTOCOL_FORBIDDEN):
                bad.setdefault(rel, []).append(name)
    return bad


def test_the_protocol_imports_only_the_pipelines_seam() -> None:
    files = sorted((PACKAGE / "protocol").rglob("*.py"))
    imports = {str(p.relative_to(REPO)): _imports(p) for p in files}
    assert not _past_the_seam(imports), _past_the_seam(imports)
    assert any(PROTOCOL_SEAM in names for names in imports.values())


def test_the_checks_catch_what_they_check() -> None:
    """The cycle finder, the tooling rule and the import reader work on known cases."""
    assert _cycle({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}}) == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert _cycle({"a": {"b": set()}, "b": {}}) is None
    assert _tooling_imports({"pipeline": {"sim": {"x.py"}}}) == {"pipeline -> sim": ["x.py"]}
    assert _tooling_imports({"bench": {"pipeline": {"x.py"}}}) == {}
    graph = _graph()
    assert "harness" in graph["bench"] and "pipeline" in graph["protocol"]
    assert _past_the_seam(
        {
            "a.py": {"extproc.pipeline.exchange", "extproc.core.api"},
            "b.py": {"extproc.pipeline.pipeline", "extproc.config.runtime", "extproc.pipeline"},
        }
    ) == {"b.py": ["extproc.config.runtime", "extproc.pipeline", "extproc.pipeline.pipeline"]}


def _requirement_names(requirements: list[str] | None) -> list[str]:
    out: list[str] = []
    for req in requirements or []:
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue  # only what an install without extras pulls in
        match = re.match(r"[A-Za-z0-9_.\-]+", req)
        if match:
            out.append(match.group(0))
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_production_dependencies_pull_in_no_plotting_or_numeric_library() -> None:
    """The image installs [project.dependencies] only (Dockerfile): walk their requirements,
    as installed here, and find none of the heavy libraries the tools use."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [_norm(n) for n in _requirement_names(project["dependencies"])]
    assert todo, "no [project.dependencies] found"
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name)
        except metadata.PackageNotFoundError:
            continue  # an optional marker-gated dependency not installed here
        todo.extend(_norm(n) for n in _requirement_names(requires))
    assert not (seen & HEAVY), sorted(seen & HEAVY)
    assert "grpcio" in seen and "redis" in seen  # the walk did reach the real dependencies
