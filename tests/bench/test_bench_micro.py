"""The micro-benchmarks behind scripts/compare, run small: the coordinator under stub workers
(every request answered through the real protocol), the decode-step cost model on a config
worked by hand, the in-process roofline run, and the shm / tcp KV hand-off (which checks the
delivered bytes itself)."""
import subprocess

import pytest

from benchmarks.roofline import decode_roofline, format_handoffs, format_roofline, kv_handoff, machine_rates, step_cost
from pdserve.bench.overhead import format_overhead, measure_overhead
from pdserve.runtime.config import ModelConfig


def test_coordinator_overhead_with_stub_workers(model_dir):
    r = measure_overhead(str(model_dir), num_requests=600, window=32, sequential=40, log=subprocess.DEVNULL)
    assert r["errors"] == 0 and r["requests"] == 600
    # every request (warm-up 40, one-at-a-time 40, windowed 600) went coordinator -> stub -> coordinator -> client
    assert r["finished"] == 680
    assert r["rps"] > 0 and 0 < r["seq_p50_ms"] <= r["seq_p99_ms"] and r["load_mean_ms"] > 0
    text = format_overhead(r)
    assert "Request throughput (req/s):" in text and "Goal >= 10000 req/s:" in text


def test_step_cost_by_hand():
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4, max_position=64)
    # per layer: q 8x8 + k,v 8x4 each + o 8x8 + gate/up/down 3x8x16 = 64+64+64+384 = 576; x2 layers + head 100x8 = 1952
    c = step_cost(cfg, batch=3, context=10)
    assert c.flops == 2 * 3 * 1952 + 3 * 2 * 4 * 2 * 4 * 10
    kv_token = 2 * 2 * 4 * 4  # K and V, 2 layers, 4 floats, 4 bytes
    assert c.bytes == 1952 * 4 + 3 * 11 * kv_token


def test_decode_roofline_runs_and_reports(model_dir):
    rates = machine_rates(1, copy_mib=16, matmul_n=256, repeats=2, peak_s=0.02)
    assert rates.copy_gbps > 0 and rates.matmul_gflops > 0 and rates.peak_gflops > 0
    # the compute ceiling is the measured FMA peak (torch.mm's rate only without the C kernels)
    assert (rates.int16_gops is None) == rates.peak_source.startswith("torch.mm")
    assert rates.int16_gops is None or (rates.int16_gops > 0 and rates.int8_gops > 0)
    r = decode_roofline(str(model_dir), 1, batch=4, prompt_len=16, steps=4, rates=rates)
    assert r.step_s > 0 and r.context == pytest.approx(16 + 1 + 3 + 1.5)
    assert r.bound_s == max(r.memory_s, r.compute_s) and r.fraction == pytest.approx(r.bound_s / r.step_s)
    assert r.compute_s == pytest.approx(r.cost.flops / (rates.peak_gflops * 1e9))
    assert "Fraction of roofline:" in format_roofline(r)


@pytest.mark.parametrize("tokens", [16, 40])
def test_kv_handoff_moves_the_right_bytes(model_dir, tokens):
    from pdserve.runtime.weights import load_checkpoint

    cfg, _ = load_checkpoint(str(model_dir), progress=False)
    rows = kv_handoff(cfg, tokens, threads=1, repeats=3)  # raises if any hand-off delivered wrong bytes
    per_block = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert [h.backend for h in rows] == ["shm", "tcp"]
    assert all(h.nbytes == -(-tokens // 16) * per_block and h.seconds > 0 and h.memcpy_seconds > 0 for h in rows)
    assert "shm" in format_handoffs(rows, 1)
