"""`pdserve bench` as users run it (a subprocess) against a real cluster on loopback: the
msgspec backend, Poisson arrivals and --max-concurrency honoured, the sweep's PNG and JSON, and
the OpenAI backends through the HTTP gateway (when this tree has one). Timings are checked only
for consistency with each other and with the schedule, never against a speed."""
import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest

from pdserve.bench.workloads import arrival_intervals
from pdserve.launch import Launcher, NodePlan
from tests.helpers import free_port

HAS_GATEWAY = importlib.util.find_spec("pdserve.gateway.server") is not None and "gateway" in {f.name for f in dataclasses.fields(NodePlan)}


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    extra = dict(gateway=True, http_port=free_port()) if HAS_GATEWAY else {}
    plan = NodePlan(model=str(model_dir), client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                    threads=1, name="t", **extra)
    launcher = Launcher(plan, log_dir=str(tmp_path_factory.mktemp("logs")))
    launcher.start()
    try:
        launcher.wait_ready(120)
        yield launcher
    finally:
        launcher.stop()


def bench(*args) -> str:
    """`pdserve bench ARGS` as a user runs it: a subprocess through the CLI; returns stdout."""
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--disable-tqdm", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def bench_here(capsys, *args) -> str:
    """The same command in this process (no interpreter start-up); returns stdout."""
    from pdserve.bench.command import main

    code = main(["--disable-tqdm", *args])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    return out.out


def test_pdserve_backend_random_workload(cluster, model_dir, tmp_path):
    out = tmp_path / "r.json"
    stdout = bench("--backend", "pdserve", "--base-url", cluster.plan.client_addr, "--tokenizer", str(model_dir), "--num-prompts", "4",
              "--input-len", "32", "--output-len", "8", "--ignore-eos", "--warmup", "1", "--save-result", str(out))
    assert "Serving Benchmark Result" in stdout and "Successful requests:                     4" in stdout
    d = json.loads(out.read_text())
    assert d["completed"] == 4 and d["failed"] == 0 and d["errors"] == [""] * 4
    assert d["input_lens"] == [32] * 4 and d["total_input_tokens"] == 128  # the coordinator counted the same prompt tokens
    assert d["output_lens"] == [8] * 4 and d["total_output_tokens"] == 32
    assert [len(i) for i in d["itls"]] == [7] * 4
    for ttft, itl, e2e in zip(d["ttfts"], d["itls"], d["e2els"]):
        assert 0 < ttft <= e2e and ttft + sum(itl) == pytest.approx(e2e, abs=0.05)
    assert d["output_throughput"] == pytest.approx(32 / d["duration"])


def test_poisson_schedule_concurrency_cap_and_sweep_plot(cluster, model_dir, tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    stdout = bench_here(capsys, "--base-url", cluster.plan.client_addr, "--tokenizer", str(model_dir), "--dataset", "jsonl",
                        "--num-prompts", "4", "--output-len", "4", "--ignore-eos", "--seed", "5", "--sweep", "8,inf",
                        "--max-concurrency", "1", "--goodput", "ttft:100000", "tpot:100000", "--plot", str(png), "--save-result", str(out))
    assert stdout.count("Serving Benchmark Result") == 2 and "Request goodput (req/s):" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    paced, burst = json.loads(out.read_text())["sweep"]
    assert (paced["request_rate"], burst["request_rate"]) == (8.0, "inf")
    for d in (paced, burst):
        assert d["completed"] == 4 and d["output_lens"] == [4] * 4 and d["max_concurrency"] == 1
        assert d["request_goodput"] == pytest.approx(d["request_throughput"])  # SLOs nobody can miss
        starts, e2e = d["start_times"], d["e2els"]
        # --max-concurrency 1: each request starts only after the previous one ended
        assert all(starts[i + 1] >= starts[i] + e2e[i] - 1e-3 for i in range(3))
    # rate 8: no request is sent before its Poisson arrival time
    due = [sum(arrival_intervals(4, 8.0, 1.0, 5)[:i]) for i in range(4)]
    assert all(s >= t - 1e-3 for s, t in zip(paced["start_times"], due))


@pytest.mark.skipif(not HAS_GATEWAY, reason="this tree has no HTTP gateway")
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_openai_backends_through_the_gateway(cluster, model_dir, tmp_path, capsys, backend):
    out = tmp_path / "o.json"
    bench_here(capsys, "--backend", backend, "--base-url", f"{cluster.plan.http_url}/v1", "--tokenizer", str(model_dir),
               "--dataset", "jsonl", "--num-prompts", "3", "--output-len", "6", "--ignore-eos", "--save-result", str(out))
    d = json.loads(out.read_text())
    assert d["completed"] == 3 and d["errors"] == [""] * 3
    assert d["output_lens"] == [6] * 3  # from the stream's usage
    assert [len(i) for i in d["itls"]] == [5] * 3 and all(t for t in d["generated_texts"])
