"""pdserve-client installs alone: a fresh venv gets only client/ (pip pulls pyzmq and msgspec
from the registry), holds no torch and none of the engine's packages, and generates against a
running service started from this checkout, with the same greedy tokens as this process's client.

Lifecycle: the venv is made without pip of its own (ensurepip would add ~20 s on a busy machine)
and this environment's pip installs a copy of client/ into it (`pip --python`; the checkout gets
no build files), in a child process while the service (tiny model, one colocated worker: the
client sees the same port either way) starts; a small script then runs under the venv's python,
away from the checkout and without PYTHONPATH, and prints what it saw as JSON. The service is
stopped with every KV block free.
"""
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from pdserve_client import Client
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

ROOT = Path(__file__).resolve().parents[2]
# what a client-only install must not hold: torch and the engine's own packages
ENGINE = ("torch", "triton", "transformers", "runtime", "kernels", "wire", "kvtransfer", "worker", "prefill", "decode", "coordinator",
          "gateway", "pdserve")
PROMPT = [5, 6, 7, 8]
SCRIPT = r"""
import asyncio, importlib.util, json, sys
import pdserve_client
from pdserve_client import AsyncClient, Client, InvalidRequest

address, engine = sys.argv[1], sys.argv[2].split(",")
with Client(address, timeout=60) as c:
    r = c.generate(token_ids=%r, max_tokens=6, temperature=0, ignore_eos=True)
    try:
        c.generate(token_ids=[5], temperature=-1)
        refused = None
    except InvalidRequest as e:
        refused = e.code


async def stream():
    async with AsyncClient(address, timeout=60) as c:
        return [d.token_ids async for d in c.stream(token_ids=%r, max_tokens=6, temperature=0, ignore_eos=True)]

print(json.dumps({"tokens": r.token_ids, "finish": r.finish_reason, "streamed": asyncio.run(stream()), "refused": refused,
                  "found": [m for m in engine if importlib.util.find_spec(m) is not None],
                  "package": pdserve_client.__file__, "prefix": sys.prefix}))
""" % (PROMPT, PROMPT)


def build_venv(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """Start building a venv with only client/ installed; (its python, the building process)."""
    src = tmp_path / "client-src"
    shutil.copytree(ROOT / "client", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    cmd = f"{sys.executable} -m venv --without-pip {venv} && {pip(python)} install -q {src}"
    return python, subprocess.Popen(["bash", "-c", cmd], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def pip(python: Path) -> str:
    """This environment's pip, working on the venv of python."""
    return f"{sys.executable} -m pip --disable-pip-version-check --python {python}"


def clean_env() -> dict:
    """This environment less what would let the checkout or this venv leak into the fresh one."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PYTHONNOUSERSITE": "1"}


def test_the_engine_depends_on_the_client_distribution():
    engine = tomllib.loads((ROOT / "pyproject.toml").read_text())
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert f"{client['name']}=={client['version']}" in engine["project"]["dependencies"]
    assert not any(p.startswith(("client", "pdserve_client")) for p in engine["tool"]["setuptools"]["packages"])


def test_client_installed_alone_generates_against_a_running_service(tmp_path):
    python, building = build_venv(tmp_path)
    model = tmp_path / "model"
    save_tiny_served_model(model)
    launcher = start_cluster(model, tmp_path / "logs", prefill=0, decode=0, colocated=1, engine_args=["--kv-cache-mb", "16"])
    try:
        out, _ = building.communicate(timeout=240)
        assert building.returncode == 0, f"the client-only install failed:\n{out[-4000:]}"
        pip_list = subprocess.run(f"{pip(python)} list --format=json", shell=True, capture_output=True, text=True, check=True, env=clean_env())
        installed = {p["name"].lower() for p in json.loads(pip_list.stdout)}
        assert {"pdserve-client", "pyzmq", "msgspec"} <= installed and "torch" not in installed and "pdserve" not in installed, installed
        run = subprocess.run([python, "-c", SCRIPT, launcher.plan.client_addr, ",".join(ENGINE)], cwd=tmp_path, env=clean_env(),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-4000:]
        seen = json.loads(run.stdout)
        assert seen["found"] == [], f"a client-only install can import {seen['found']}"
        assert Path(seen["package"]).is_relative_to(seen["prefix"]), seen  # the venv's copy ran, not the checkout's
        with Client(launcher.plan.client_addr, timeout=60) as c:
            want = c.generate(token_ids=PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids
            assert seen["tokens"] == want and len(want) == 6 and seen["finish"] == "length"
            assert [t for d in seen["streamed"] for t in d] == want
            assert seen["refused"] == "invalid_sampling_params"
            wait_all_blocks_free(c)
    finally:
        if building.poll() is None:
            building.kill()
        launcher.stop()
