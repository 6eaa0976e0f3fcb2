"""No pickle anywhere: every shipped Python file (the packages runtime, kernels, prefill, decode,
kvtransfer, coordinator, pdserve) is parsed and its syntax tree searched for the ways pickle gets
in: importing pickle (or cPickle, _pickle, cloudpickle, dill, shelve, joblib), pyzmq's
send_pyobj / recv_pyobj (and multipart / serialized variants), pandas' read_pickle,
`torch.load` without `weights_only=True`, and `np.load(..., allow_pickle=True)`. A failure
names the file and line. The scanner itself is checked first against snippets that must and
must not be flagged, so a scanner that finds nothing cannot pass by accident.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "kernels", "wire", "kvtransfer", "worker", "prefill", "decode", "coordinator", "client/pdserve_client", "gateway", "pdserve")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "joblib"}
PICKLE_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized", "read_pickle", "to_pickle"}


def _is_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def pickle_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each way `source` could unpickle or pickle."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in PICKLE_MODULES:
            found.append((node.lineno, f"__import__({node.args[0].value!r})"))
        elif isinstance(node, ast.Attribute) and node.attr in PICKLE_CALLS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load") and not _is_true(kw.get("weights_only")):
                found.append((node.lineno, "torch.load without weights_only=True"))
            if name.split(".")[-1] == "load" and name.split(".")[0] in ("np", "numpy") and "allow_pickle" in kw \
                    and not (isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
                found.append((node.lineno, "np.load with allow_pickle"))
    return found


def shipped_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("snippet, flagged", [
    ("import pickle", True),
    ("import cloudpickle as cp", True),
    ("from pickle import loads", True),
    ("from dill import dumps", True),
    ("__import__('pickle')", True),
    ("sock.send_pyobj(x)", True),
    ("obj = sock.recv_pyobj()", True),
    ("torch.load(path)", True),
    ("torch.load(path, weights_only=False)", True),
    ("torch.load(path, weights_only=True)", False),
    ("np.load(path, allow_pickle=True)", True),
    ("numpy.load(path, allow_pickle=flag)", True),
    ("np.load(path)", False),
    ("np.load(path, allow_pickle=False)", False),
    ("msg = decoder.decode(frames[0])  # 'pickle' in a comment is fine", False),
    ("'''no pickle anywhere'''", False),
    ("import msgspec", False),
])
def test_scanner(snippet, flagged):
    assert bool(pickle_uses(snippet)) == flagged


def test_no_pickle_in_shipped_code():
    files = shipped_files()
    assert len(files) > 30 and any(f.name == "protocol.py" for f in files)  # the scan saw the packages
    found = [f"{f.relative_to(ROOT)}:{line}: {what}" for f in files for line, what in pickle_uses(f.read_text())]
    assert not found, "pickle on a shipped path:\n" + "\n".join(found)
