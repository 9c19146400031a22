"""The shape of the house: packages per capability, no import cycles, small modules.

Imports are read from the source (inside functions too), so a cycle hidden behind a
lazy import still counts. See ARCHITECTURE.md for the layers these checks keep.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distcache", "launch")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom,
             known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base.pop()
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # "from pkg import sub" depends on pkg.sub; "from pkg import name" on pkg.
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
            for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, counting imports in functions."""
    known = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(module, path, node, known):
                    if target in known and target != module:
                        graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for vertex in sorted(set(graph).union(*graph.values())):
        if vertex not in index:
            visit(vertex)
    return found


def test_no_import_cycles_among_the_library_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(_modules()))
def test_module_stays_under_the_size_guide(module: str) -> None:
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by concept"


def test_no_flat_prefix_families() -> None:
    """Three or more sibling modules sharing a ``prefix_`` belong in a package."""
    siblings: dict[tuple[Path, str], list[str]] = defaultdict(list)
    for path in _modules().values():
        stem = path.stem.lstrip("_")
        if "_" in stem and path.name != "__init__.py":
            siblings[(path.parent, stem.split("_")[0])].append(path.name)
    families = {f"{d.name}/{p}_*": names for (d, p), names in siblings.items() if len(names) > 1}
    assert families == {}


def test_no_test_harness_inside_the_library() -> None:
    testing = ROOT / "distcache" / "testing"
    harness = [p.name for p in testing.glob("*.py")
               if re.search(r"\b(subprocess|mpirun|os\.killpg|setsid)\b", p.read_text())]
    assert harness == []


def test_all_only_in_public_fronts() -> None:
    """Private modules (a leading underscore) leave ``__all__`` to their package."""
    offenders = [str(p.relative_to(ROOT)) for p in _modules().values()
                 if p.name.startswith("_") and p.name not in ("__init__.py", "__main__.py")
                 and re.search(r"^__all__\s*=", p.read_text(), re.M)]
    assert offenders == []


def test_scripts_and_tests_do_not_edit_sys_path() -> None:
    offenders = [str(p.relative_to(ROOT))
                 for folder in ("scripts", "tests")
                 for p in (ROOT / folder).rglob("*.py")
                 if p.name != Path(__file__).name
                 and re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert offenders == []
