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
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT_DIST = ROOT / "client"  # the pdserve-client distribution: its package is client/pdserve_client
# the design card's top-level folders, each imported as pdserve.<folder> (pyproject.toml's package-dir)
FOLDERS = ("common", "kernels", "runtime", "wire", "kvtransfer", "decode", "worker", "prefill", "coordinator", "gateway")
PACKAGES = {"pdserve_client": CLIENT_DIST / "pdserve_client", **{p: ROOT / p for p in (*FOLDERS, "pdserve", "benchmarks")}}  # package -> its folder
GONE = ("client", *FOLDERS)  # import roots that no longer exist (pdserve_client; pdserve.<folder>): an import of one is stale
NOT_SHIPPED = ("benchmarks",)  # in the repository, not in the wheel
ROOTS = ("pdserve", "pdserve_client", "benchmarks")  # the import roots of what this repository holds


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CLIENT_DIST if path.is_relative_to(CLIENT_DIST) else ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in FOLDERS:
        parts.insert(0, "pdserve")
    return ".".join(parts)


def package_of(module: str) -> str:
    """The package (a key of PACKAGES) a module name belongs to: pdserve.kernels.quant -> kernels."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in FOLDERS else parts[0]


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
    return {module_name(p): p for folder in PACKAGES.values() for p in folder.rglob("*.py")}


def module_graph() -> dict[str, set[str]]:
    mods = source_modules()
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def package_graph() -> dict[str, set[str]]:
    graph = {p: set() for p in PACKAGES}
    for mod, deps in module_graph().items():
        graph[package_of(mod)].update(package_of(d) for d in deps)
    for pkg in graph:
        graph[pkg].discard(pkg)
    return graph


def top_level(body: list[ast.stmt]):
    """The statements run when a module is imported (into if / try / with blocks, not functions)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from top_level([n for n in getattr(node, field, []) if isinstance(n, (ast.stmt, ast.excepthandler))])


def bound_names(path: Path, mods: dict[str, Path]) -> dict[str, str]:
    """name -> where a module's top level gets it: "" for its own classes, functions and
    assignments, the module it imports it from otherwise (star imports of pdserve modules followed)."""
    names = {}
    for node in top_level(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = ""
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            names.update((n.id, "") for t in getattr(node, "targets", None) or [node.target] for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*" and node.module in mods:
            names.update(dict.fromkeys(bound_names(mods[node.module], mods), node.module))
        elif isinstance(node, ast.ImportFrom):
            names.update((a.asname or a.name, node.module or "") for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(((a.asname or a.name).split(".")[0], a.name) for a in node.names)
    return names


def stale_imports(files: list[Path], mods: dict[str, Path]) -> list[str]:
    """`path:line: from M import n` for each import of a pdserve module M that is gone, of an n M
    does not have (nor as a submodule), or of an n the client distribution defines from an engine
    module that merely imports it (it is imported from pdserve_client, its one home)."""
    bound, found = {}, []
    for path in files:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in (*ROOTS, *GONE)):
                continue
            namespace = {m.rsplit(".", 1)[0] for m in mods if m.startswith(node.module + ".")} - set(mods)
            if node.module in namespace:  # a folder without __init__.py: only its modules can be imported from it
                found += [f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if f"{node.module}.{a.name}" not in mods]
                continue
            if node.module not in mods:
                found.append(f"{where}:{node.lineno}: from {node.module} (no such module)")
                continue
            if node.module not in bound:
                bound[node.module] = bound_names(mods[node.module], mods)
            engine = not node.module.startswith("pdserve_client")
            found += [f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name != "*" and f"{node.module}.{a.name}" not in mods
                      and (a.name not in bound[node.module] or engine and bound[node.module][a.name].startswith("pdserve_client"))]
    return found


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
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not [p for p in listed if p.split(".")[0] != "pdserve" or any(n in p.split(".") for n in NOT_SHIPPED)]


def test_one_import_root_and_no_folder_that_shadows_a_package():
    """The wheel's packages are pdserve.* alone, each of the design card's folders mapped into it;
    no top-level folder but pdserve/ has an __init__.py (a regular package at the repository's
    root would shadow any installed package of its name, Hugging Face's `kernels` say, for every
    Python started there); benchmarks/ and tests/ are namespace folders for the same reason."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"pdserve": "pdserve", **{f"pdserve.{f}": f for f in FOLDERS}}
    assert {f"pdserve.{f}" for f in FOLDERS} <= set(setuptools["packages"])
    shadowing = sorted(d.name for d in ROOT.iterdir() if d.is_dir() and d.name != "pdserve" and (d / "__init__.py").exists())
    assert not shadowing, f"top-level folders that shadow any installed package of their name: {shadowing}"
    assert not [str(p.relative_to(ROOT)) for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")]


def test_no_package_imports_one_that_imports_it_back():
    assert find_cycle(package_graph()) is None, f"packages import each other: {' -> '.join(find_cycle(package_graph()))}"


def test_no_circle_of_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, f"modules import each other: {' -> '.join(cycle)}"


def test_the_checks_see_circles_lazy_and_relative_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    f = tmp_path / "m.py"
    f.write_text("import zmq\n\ndef f():\n    from pdserve.wire.protocol import Hello\n    from .pool import copy_blocks\n")
    assert imports_of(f, "pdserve.kvtransfer.m") >= {"zmq", "pdserve.wire.protocol", "pdserve.kvtransfer.pool", "pdserve.kvtransfer.pool.copy_blocks"}


def test_no_import_uses_a_path_the_client_distribution_replaced():
    """A moved name fails here even in a lazy import no other test runs (after a merge, say): each
    `from M import n` in the packages, tests and scripts names a module M that exists and an n it
    has, and takes what pdserve_client defines from pdserve_client (stale_imports)."""
    mods = source_modules()
    files = [*mods.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    assert not (found := stale_imports(files, mods)), "imports of a name from where it is not defined:\n" + "\n".join(found)


def test_the_stale_import_check_sees_moved_names(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from pdserve.wire.protocol import Hello, GenerateRequest\nfrom pdserve.common.errors import PdserveError, NotSupportedError\n"
                 "from pdserve_client import Client\nfrom runtime.errors import ModelLoadError\n\ndef f():\n    from client import Client\n")
    assert sorted(s.split(": ", 1)[1] for s in stale_imports([f], source_modules())) == [
        "from client (no such module)", "from pdserve.common.errors import PdserveError", "from pdserve.wire.protocol import GenerateRequest",
        "from runtime.errors (no such module)"]


def test_the_client_distribution_imports_only_pyzmq_and_msgspec():
    """pdserve_client installs alone: it imports the standard library, msgspec, zmq and itself,
    and its pyproject asks for exactly those two (tests/client/test_distribution.py installs it)."""
    allowed = set(sys.stdlib_module_names) | {"pdserve_client", "msgspec", "zmq"}
    found = {i.split(".")[0] for p in PACKAGES["pdserve_client"].rglob("*.py") for i in imports_of(p)}
    assert {"pdserve_client", "msgspec", "zmq"} <= found, found  # the scan saw its imports
    assert found <= allowed, f"pdserve_client imports beyond pyzmq and msgspec: {sorted(found - allowed)}"
    deps = tomllib.loads((CLIENT_DIST / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(re.match(r"[\w-]+", d).group() for d in deps) == ["msgspec", "pyzmq"]


def test_every_listed_package_folder_is_in_a_clean_clone():
    """setuptools refuses to build (`package directory 'kernels/_native' does not exist`) when a
    listed package's folder is missing, and a clean clone holds only the tracked files: each
    package's folder (package-dir mapping, the rest by its dotted path) holds a file git tracks."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    folders = {str(Path(f).parent) for f in tracked}

    def folder(package: str) -> str:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            if (mapped := setuptools["package-dir"].get(".".join(parts[:n]))) is not None:
                return str(Path(mapped, *parts[n:]))
        return str(Path(*parts))

    missing = [p for p in setuptools["packages"] if folder(p) not in folders]
    assert not missing, f"listed packages whose folder a clean clone lacks: {missing}"
