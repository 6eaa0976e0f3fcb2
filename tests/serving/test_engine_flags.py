"""`vllm serve`'s engine flags on `pdserve launch`, through the real command line: every worker
runs with them (`pdserve stats` shows each worker's settings), the gateway answers to
--served-model-name, and a bad value is a usage error before anything starts."""
import json
import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers import free_port, save_tiny_served_model
from tests.serving.test_launcher import pdserve, wait_ready


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def test_launch_engine_flags_reach_every_worker(model_dir, tmp_path):
    """The issue's command line (--dtype float32 --max-num-seqs 8 --kv-cache-mb 128) and the other flags."""
    clients, workers, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    proc = pdserve("launch", "--model", str(model_dir), "--clients", clients, "--workers", workers, "--threads", "1",
                   "--http-port", str(http), "--log-dir", str(tmp_path),
                   "--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-mb", "128", "--max-model-len", "256",
                   "--max-num-batched-tokens", "512", "--block-size", "8", "--device", "cpu", "--served-model-name", "tiny-chat",
                   "--quant-activations", "int8")
    try:
        wait_ready(proc, clients, 2)
        out = subprocess.run([sys.executable, "-m", "pdserve", "stats", "--coordinator", clients], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert sorted(w["role"] for w in stats["workers"]) == ["decode", "prefill"]
        for w in stats["workers"]:
            e = w["engine"]
            assert (e["dtype"], e["device"], e["max_num_seqs"], e["kv_cache_mb"], e["max_model_len"], e["max_num_batched_tokens"],
                    e["block_size"]) == ("float32", "cpu", 8, 128, 256, 512, 8), w
            assert w["max_model_len"] == 256 and w["block_size"] == 8 and e["quant_activations"] == "int8"
            assert 127 < e["kv_pool_mb"] <= 128  # the pool fills the budget, in whole blocks
            # the default --linear-backend auto: the measured table, one line per linear shape (qkv, o, gate_up, down, LM head)
            assert e["linear_backend"] == "auto" and len(e["linear_table"].splitlines()) == 5, e["linear_table"]
            assert all(line.split(": ")[0].endswith(" f32") for line in e["linear_table"].splitlines())
        models = httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60,
                       json={"model": "tiny-chat", "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory-utilization", "0.9"], "gpu_memory_utilization needs a CUDA device"),
    (["--gpu-memory-utilization", "1.5", "--device", "cuda"], "gpu_memory_utilization must be in (0, 1]"),
    (["--block-size", "12"], "block_size must be a power of two"),
    (["--dtype", "float64"], "'float64' is not one of"),
    (["--max-model-len", "0"], "max_model_len must be >= 1"),
])
def test_bad_engine_flag_is_a_usage_error_before_anything_starts(flags, message):
    out = subprocess.run([sys.executable, "-m", "pdserve", "launch", "--clients", f"tcp://127.0.0.1:{free_port()}", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "pdserve ready" not in out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "4096"], "max_model_len 4096 is longer than the model's context (1024 tokens)"),
    # issue 40: a context the KV pool cannot hold is known at start, not at the first long request
    (["--max-model-len", "1024", "--engine-arg=--num-blocks=8"], "max_model_len 1024 does not fit the KV pool"),
])
def test_a_context_the_model_or_pool_cannot_hold_stops_the_launch(model_dir, tmp_path, flags, message):
    """The tiny model has a 1024-token context: asking for more is refused, as vllm serve does; so is
    a context one sequence could not hold in the KV pool (8 blocks of 8 here)."""
    out = subprocess.run([sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--colocated", "--no-gateway",
                          "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                          "--threads", "1", *flags, "--log-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "colocated-0 (pid" in out.stderr and "cannot start with this configuration" in out.stderr  # exit 78: not restarted
    log = (tmp_path / "colocated-0.log").read_text()
    assert message in log


def test_linear_backend_choices_are_the_engines():
    """runtime/config.py names --linear-backend's and --quant-activations' choices without importing torch; they must be the kernels'."""
    from pdserve.kernels.backends import BY_NAME
    from pdserve.kernels.cpu_native import ACTIVATION_MODES
    from pdserve.runtime.config import LINEAR_BACKENDS, QUANT_ACTIVATIONS

    assert LINEAR_BACKENDS == ("auto", "auto-reduced", "rules", *BY_NAME)
    assert sorted(QUANT_ACTIVATIONS) == sorted(ACTIVATION_MODES)
