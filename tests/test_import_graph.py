"""The import graph between pdserve's packages, read from the source with `ast`, against the
rule in docs/architecture.md's layout section ("Who imports whom").

Every `import` counts, at module level or inside a function (a lazy import is still a
dependency). The test fails when a package imports one the rule does not allow it to, when two
packages import each other (directly or round a longer circle), or when modules inside one
package import each other in a circle. benchmarks/ (not shipped) may import anything, but
nothing shipped may import it, and the package list in pyproject.toml must leave it out.
"""
from __future__ import annotations

import ast
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "runtime", "wire", "kvtransfer", "worker", "prefill", "decode", "coordinator", "client", "gateway", "pdserve",
            "benchmarks")
NOT_SHIPPED = ("benchmarks",)  # in the repository, not in the wheel


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str | None = None) -> set[str]:
    """Absolute module names imported by the file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    here = (module or module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def module_graph() -> dict[str, set[str]]:
    mods = source_modules()
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def package_graph() -> dict[str, set[str]]:
    graph = {p: set() for p in PACKAGES}
    for mod, deps in module_graph().items():
        graph[mod.split(".")[0]].update(d.split(".")[0] for d in deps)
    for pkg in graph:
        graph[pkg].discard(pkg)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


RULE_FILE = ROOT / "docs" / "architecture.md"


def documented_rule() -> dict[str, set[str] | None]:
    """package -> the packages it may import (None: any), from docs/architecture.md's import-graph block."""
    text = RULE_FILE.read_text()
    block = re.search(r"Who imports whom.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no 'Who imports whom' block in its layout section"
    rule = {}
    for line in block.group(1).splitlines():
        m = re.match(r"\s*(\w+)\s+->\s+([^#]*)", line)
        if m:
            deps = m.group(2).strip()
            rule[m.group(1)] = None if deps == "anything" else {d.strip() for d in deps.split(",") if d.strip() and d.strip() != "nothing"}
    return rule


def test_the_rule_names_every_package():
    assert set(documented_rule()) == set(PACKAGES)


def test_every_package_imports_only_what_the_rule_allows():
    rule = documented_rule()
    extra = {pkg: sorted(deps - rule[pkg]) for pkg, deps in package_graph().items() if rule[pkg] is not None and deps - rule[pkg]}
    assert not extra, f"imports docs/architecture.md's layout section does not allow: {extra}"


def test_nothing_shipped_imports_what_is_not_shipped():
    graph = package_graph()
    shipped = [p for p in PACKAGES if p not in NOT_SHIPPED]
    assert not {p: sorted(graph[p] & set(NOT_SHIPPED)) for p in shipped if graph[p] & set(NOT_SHIPPED)}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in NOT_SHIPPED if any(fnmatch(p, g) or fnmatch(f"{p}.x", g) for g in include)]


def test_no_package_imports_one_that_imports_it_back():
    assert find_cycle(package_graph()) is None, f"packages import each other: {' -> '.join(find_cycle(package_graph()))}"


def test_no_circle_of_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, f"modules import each other: {' -> '.join(cycle)}"


def test_the_checks_see_circles_lazy_and_relative_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    f = tmp_path / "m.py"
    f.write_text("import zmq\n\ndef f():\n    from wire.protocol import Hello\n    from .pool import copy_blocks\n")
    assert imports_of(f, "kvtransfer.m") >= {"zmq", "wire.protocol", "kvtransfer.pool", "kvtransfer.pool.copy_blocks"}


def test_the_old_client_import_path_still_works():
    from client import AsyncClient, Client
    from coordinator.client import AsyncClient as OldAsync, Client as OldClient

    assert (OldClient, OldAsync) == (Client, AsyncClient)
