"""scripts/vs_vllm's table: ratios to vLLM for every other row, from known metrics, and its
command line (rows are checked before anything starts)."""
from benchmarks import vs_vllm as vs
from benchmarks.servers import Workload
from pdserve.bench.metrics import RequestOutput, compute_metrics


def metrics(ttft: float, itl: float, n: int, duration: float):
    outs = [RequestOutput(prompt_len=8, output_tokens=5, success=True, ttft=ttft, itl=[itl] * 4, latency=ttft + 4 * itl)
            for _ in range(n)]
    return compute_metrics(outs, duration)


def test_table_gives_each_row_its_ratio_to_vllm():
    w = [Workload("2 at once", [], None)]
    table = vs.format_tables(
        {"vllm": {"2 at once": metrics(0.2, 0.05, 2, 1.0)}, "colocated": {"2 at once": metrics(0.1, 0.10, 2, 0.5)}},
        {"vllm": 60.0, "colocated": 20.0}, w,
    )
    row = next(line for line in table.splitlines() if line.startswith("pdserve colocated"))
    assert "2.00x tok/s" in row and "p99 TTFT 0.50x" in row and "TPOT 2.00x" in row
    assert "vLLM CPU 0.32 (float32) 60.0" in table


def test_without_vllm_each_pdserve_row_gets_its_tpot_ratio_to_llama_cpp_and_bursts_may_be_none():
    w = [Workload("1 stream", [], 1)]
    table = vs.format_tables(
        {"llamacpp": {"1 stream": metrics(0.2, 0.010, 1, 1.0)}, "colocated": {"1 stream": metrics(0.1, 0.005, 1, 0.5)}},
        {"llamacpp": 1.0, "colocated": 20.0}, w,
    )
    row = next(line for line in table.splitlines() if line.startswith("pdserve colocated"))
    assert "TPOT 0.50x llama.cpp's" in row and "x tok/s" not in row  # (no vLLM row: no ratio to it)
    assert vs.burst_sizes("") == [] and vs.burst_sizes("32,64") == [32, 64]


def test_unknown_rows_are_refused_before_anything_starts(capsys):
    assert vs.main(["--rows", "vllm,nope"]) == 2
    assert "nope" in capsys.readouterr().err
