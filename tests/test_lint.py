"""The linter over the whole repository: `ruff check` with the rules pyproject.toml's [tool.ruff]
states (why each is in or out is written there). Fix what it finds with `.venv/bin/ruff check --fix .`."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_ruff_sees_a_fault(tmp_path):
    """The check can fail: an undefined name and an unused import are reported with the repository's rules."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                        "--output-format", "concise", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "F401" in r.stdout and "F821" in r.stdout, r.stdout
