"""`vllm bench serve` command lines on `pdserve bench`, against a launched service's HTTP gateway
(real processes on loopback): the command line runs unchanged through the CLI, the result file
is named and keyed as vLLM writes it, --percentile-metrics / --metric-percentiles choose what
the report and the file carry, the sharegpt (a JSON array file) and prefix_repetition datasets
run, and a bad flag value is a usage error naming the flag."""
import json
import re
import subprocess
import sys

import pytest

from pdserve.launch import Launcher, NodePlan
from tests.helpers import free_port

VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"}
DETAIL_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"}


def stat_keys(metrics, percentiles):
    return {f"{s}_{m}_ms" for m in metrics for s in ("mean", "median", "std", *(f"p{p}" for p in percentiles))}


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    port = free_port()
    plan = NodePlan(prefill=0, decode=0, colocated=1, model=str(model_dir), client_addr=f"tcp://127.0.0.1:{free_port()}",
                    worker_addr=f"tcp://127.0.0.1:{free_port()}", threads=1, name="v", gateway=True, http_port=port,
                    engine_args=["--kv-cache-mb", "16"])
    launcher = Launcher(plan, log_dir=str(tmp_path_factory.mktemp("logs")))
    launcher.start()
    try:
        launcher.wait_ready(120)
        yield port
    finally:
        launcher.stop()


def bench_here(capsys, *args) -> str:
    from pdserve.bench.command import main

    code = main(["--disable-tqdm", *args])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    return out.out


def test_a_vllm_bench_serve_command_line_runs_unchanged(gateway, model_dir, tmp_path):
    name = model_dir.name
    cmd = ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(gateway), "--model", name, "--tokenizer", str(model_dir),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "6", "--num-prompts", "4",
           "--request-rate", "inf", "--max-concurrency", "2", "--num-warmups", "1", "--seed", "1", "--trust-remote-code",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9", "--save-result",
           "--result-dir", str(tmp_path / "results"), "--label", "smoke", "--metadata", "tp=1", "note=ci", "--disable-tqdm"]
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", *cmd], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("Successful requests:                     4", "Peak output token throughput (tok/s):", "P99.9 TTFT (ms):",
                 "P50 E2EL (ms):", "P90 ITL (ms):"):
        assert line in r.stdout
    [path] = list((tmp_path / "results").iterdir())
    assert re.fullmatch(rf"smoke-infqps-concurrency2-{re.escape(name)}-\d{{8}}-\d{{6}}\.json", path.name), path.name
    d = json.loads(path.read_text())
    assert set(d) == VLLM_KEYS | {"tp", "note"} | stat_keys(("ttft", "tpot", "itl", "e2el"), ("50", "90", "99.9"))
    assert (d["endpoint_type"], d["backend"], d["label"], d["model_id"], d["num_prompts"]) == ("openai", "openai", "smoke", name, 4)
    assert (d["tp"], d["note"], d["request_rate"], d["max_concurrency"], d["request_goodput"]) == ("1", "ci", "inf", 2, None)
    assert d["completed"] == 4 and d["failed"] == 0
    assert d["total_input_tokens"] == 4 * 32 and d["total_output_tokens"] == 4 * 6  # random: ignore_eos, as vLLM sets it
    assert 1 <= d["max_concurrent_requests"] <= 4 and 0 < d["max_output_tokens_per_s"] <= 24  # per one-second bucket, as vLLM counts
    assert d["p50_ttft_ms"] == pytest.approx(d["median_ttft_ms"]) and d["p99.9_e2el_ms"] >= d["p90_e2el_ms"]


def test_vllm_defaults_detailed_append_and_filename(gateway, model_dir, tmp_path, capsys):
    """No --backend: --port means an OpenAI server; the default report follows pdserve (all four
    metrics at p90, p99); --save-detailed keeps the per-request lists; --append-result adds a line."""
    args = ["--port", str(gateway), "--tokenizer", str(model_dir), "--dataset-name", "random", "--input-len", "16",
            "--output-len", "3", "--num-prompts", "2", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
            "--result-filename", "r.json", "--percentile-metrics", "ttft", "--metric-percentiles", "99"]
    out = bench_here(capsys, *args)
    assert "P99 TTFT (ms):" in out and "TPOT" not in out and "P90" not in out
    bench_here(capsys, *args, "--append-result")
    first, second = [json.loads(line) for line in (tmp_path / "r.json").read_text().splitlines()]
    for d in (first, second):
        assert set(d) == VLLM_KEYS | DETAIL_KEYS | stat_keys(("ttft",), ("99",))
        assert d["backend"] == "openai" and d["label"] is None and d["model_id"] == model_dir.name  # the server's first model
        assert d["input_lens"] == [16, 16] and d["output_lens"] == [3, 3] and d["errors"] == ["", ""]


def test_sharegpt_json_array_through_the_chat_endpoint(gateway, model_dir, tmp_path, capsys):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"Tell me about the number {i}." + " Please." * i},
                                              {"from": "gpt", "value": "It is a number."}]} for i in range(3)]
    data = tmp_path / "ShareGPT_V3_small.json"
    data.write_text(json.dumps(rows))
    bench_here(capsys, "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{gateway}", "--endpoint", "/v1/chat/completions",
               "--model", model_dir.name, "--tokenizer", str(model_dir), "--dataset-name", "sharegpt", "--dataset-path", str(data),
               "--sharegpt-output-len", "5", "--ignore-eos", "--num-prompts", "3", "--save-result", "--save-detailed",
               "--result-dir", str(tmp_path / "out"))
    [path] = list((tmp_path / "out").iterdir())
    assert path.name.startswith(f"openai-chat-infqps-{model_dir.name}-")
    d = json.loads(path.read_text())
    assert d["completed"] == 3 and d["output_lens"] == [5] * 3 and len(set(d["input_lens"])) >= 2


def test_prefix_repetition(gateway, model_dir, tmp_path, capsys):
    bench_here(capsys, "--port", str(gateway), "--tokenizer", str(model_dir), "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", "24", "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
               "--prefix-repetition-output-len", "2", "--ignore-eos", "--num-prompts", "4", "--save-result", "--save-detailed",
               "--result-filename", str(tmp_path / "p.json"))
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["completed"] == 4 and d["input_lens"] == [32] * 4 and d["output_lens"] == [2] * 4


def test_prefix_repetition_prompts_share_prefixes(model_dir):
    from pdserve.bench.workloads import prefix_repetition_requests
    from pdserve.common.tokenizer import load_tokenizer

    reqs = prefix_repetition_requests(load_tokenizer(str(model_dir)), 6, 20, 5, 3, 4, seed=0)
    assert len(reqs) == 6 and all(r.prompt_len == 25 and r.output_len == 4 for r in reqs)
    prefixes = [tuple(r.token_ids[:20]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 2 for p in set(prefixes))
    assert len({tuple(r.token_ids) for r in reqs}) == 6


@pytest.mark.parametrize("flags, message", [
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics takes names from ttft,tpot,itl,e2el"),
    (["--metric-percentiles", "0,50"], "--metric-percentiles must be in (0, 100]"),
    (["--metric-percentiles", "p99"], "--metric-percentiles takes numbers"),
    (["--metadata", "novalue"], "--metadata takes KEY=VALUE"),
    (["--min-p", "0.1"], "--min-p: only with the openai backends"),
])
def test_bad_vllm_flags_are_usage_errors(flags, message, capsys):
    from pdserve.bench.command import main

    assert main(["--backend", "pdserve", "--num-prompts", "1", *flags]) == 2
    assert message in capsys.readouterr().err
