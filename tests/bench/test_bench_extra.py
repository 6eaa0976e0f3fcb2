"""The `bench` extra: matplotlib and httpx are not dependencies of the engine. In a Python that
cannot import matplotlib, the engine's servers and every module of `pdserve.bench` import and
`--sweep` stops, before anything is sent, with an error naming the extra; so does
`--backend openai` without httpx. (transformers' hub client imports httpx itself, so httpx is
checked the other way too: no shipped module imports it at load.) pyproject.toml and
scripts/install agree."""
import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.test_import_graph import NOT_SHIPPED, PACKAGES

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ("matplotlib", "httpx")

WITHOUT_EXTRA = """
import importlib, pkgutil, sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"no {name} here")

sys.meta_path.insert(0, NoMatplotlib())
import pdserve.coordinator.server, pdserve.gateway.server, pdserve.cli, pdserve.launch, pdserve.runtime.engine, pdserve.bench
for m in pkgutil.iter_modules(pdserve.bench.__path__):
    if m.name != "__main__":
        importlib.import_module(f"pdserve.bench.{m.name}")
from pdserve.bench.command import main
print("sweep", main(["--backend", "pdserve", "--base-url", "tcp://127.0.0.1:9", "--sweep", "1", "--num-prompts", "1"]))
sys.modules["httpx"] = None  # from here on `import httpx` fails
print("openai", main(["--backend", "openai", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
                      "--input-len", "4", "--output-len", "2", "--disable-tqdm"]))
print("matplotlib loaded", any(m.split(".")[0] == "matplotlib" for m in sys.modules))
"""


def test_engine_and_bench_run_without_the_extra_and_name_it_when_needed():
    r = subprocess.run([sys.executable, "-c", WITHOUT_EXTRA], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["sweep 2", "openai 2", "matplotlib loaded False"], r.stdout + r.stderr[-3000:]
    assert "pdserve bench: --sweep's plot needs matplotlib: pip install 'pdserve[bench]'" in r.stderr
    assert "pdserve bench: --backend openai(-chat) needs httpx: pip install 'pdserve[bench]'" in r.stderr


def test_no_shipped_module_imports_the_extra_at_load():
    found = []
    for pkg in (p for p in PACKAGES if p not in NOT_SHIPPED):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text(), str(path)).body:  # module level only: lazy imports are the point
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in EXTRA]
    assert not found


def test_the_extra_is_declared_and_installed_by_scripts_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}  # noqa: E731
    assert not names(project["dependencies"]) & set(EXTRA)
    assert names(project["optional-dependencies"]["bench"]) == set(EXTRA)
    install = (ROOT / "scripts" / "install").read_text()
    assert 'extras="[bench,' in install and '$EDITABLE ".$extras"' in install
