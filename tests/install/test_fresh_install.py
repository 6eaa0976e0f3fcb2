"""A fresh machine runs it: a new virtual environment built from requirements.lock by
scripts/install (pdserve as a built wheel, beside Hugging Face's own `kernels`, which transformers
>= 5.25 requires), in which transformers and pdserve load in one interpreter from the repository
root and from elsewhere, and `pdserve launch` answers /health and a chat.

Full tier (marker `install`): it installs a whole environment (~1-2 min with the installer's cache
warm, which scripts/test's own install leaves it)."""
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, save_tiny_served_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.install, pytest.mark.timeout(600)]

BOTH = """
import sys, kernels, transformers
from transformers import AutoModelForCausalLM, LlamaConfig
import pdserve.kernels.paged, pdserve.runtime.engine
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, vocab_size=100))
print(kernels.__file__, hasattr(kernels, "CUDAProperties"), pdserve.kernels.paged.__file__, transformers.__version__, sep="\\n")
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("fresh") / "venv"
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / "scripts" / "install"), "--venv", str(d), "--wheel"], capture_output=True, text=True, timeout=540,
                       env={**os.environ, "PDSERVE_COMPILE_BYTECODE": "0"})  # (bytecode: an environment used once)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"fresh install from the lock: {time.monotonic() - t0:.0f} s")
    return d


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def norm(name: str, version: str) -> tuple[str, str]:
    return re.sub(r"[-_.]+", "-", name).lower(), version.strip()


def test_the_wheel_installs_pdserve_alone_as_its_top_level_package(venv):
    record = next(site_packages(venv).glob("pdserve-*.dist-info")) / "RECORD"
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"pdserve"}, sorted(tops)
    record = next(site_packages(venv).glob("pdserve_client-*.dist-info")) / "RECORD"
    assert {line.split("/")[0] for line in record.read_text().splitlines() if not line.split("/")[0].endswith(".dist-info")} == {"pdserve_client"}
    pinned = dict(norm(*line.split("==")) for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line and not line.startswith("#"))
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True).stdout
    installed = dict(norm(p["name"], p["version"]) for p in json.loads(out))
    assert installed["kernels"] == pinned["kernels"]  # Hugging Face's, beside ours
    wrong = {n: (installed.get(n), v) for n, v in pinned.items() if installed.get(n) != v}
    assert not wrong, f"installed versions that are not the lock's: {wrong}"


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_transformers_and_pdserve_load_in_one_interpreter(venv, where, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    r = subprocess.run([str(venv / "bin" / "python"), "-c", BOTH], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    hf_kernels, has_cuda_properties, ours, _ = r.stdout.split()
    assert Path(hf_kernels).is_relative_to(site_packages(venv)) and has_cuda_properties == "True"
    assert Path(ours).is_relative_to(ROOT if where == "root" else site_packages(venv)), ours  # from the root: the checkout's


def test_a_launch_in_the_fresh_environment_answers_health_and_a_chat(venv, tmp_path):
    model = tmp_path / "model"
    save_tiny_served_model(model)
    port = free_port()
    log = open(tmp_path / "launch.log", "w")
    proc = subprocess.Popen([str(venv / "bin" / "pdserve"), "launch", "--model", f"{model}=tiny", "--colocated", "--threads", "1",
                             "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                             "--http-port", str(port), "--log-dir", str(tmp_path), "--engine-arg=--kv-cache-mb=8"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 240, None
        while time.monotonic() < deadline and status != 200:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2).status
            except OSError:
                time.sleep(0.5)
        assert status == 200, (tmp_path / "launch.log").read_text()[-3000:]
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["message"]["content"] is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert not os.path.exists(f"/proc/{proc.pid}")
