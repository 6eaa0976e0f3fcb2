#!/usr/bin/env python
"""SLO benchmark (issue 6): goodput of disaggregated vs colocated serving at the same offered
load, and how well the coordinator predicts TTFT.

Lifecycle: measure the disaggregated capacity (1 prefill + 1 decode, SLO control off, every
request sent at once) -> offer `--load` times that rate, as Poisson arrivals of the same
requests, to four clusters launched one after another on this node: disaggregated and colocated
(one worker with every core), each with SLO control (`--ttft-ms`, `--tpot-ms`) and without
-> print one table: served,
shed, failed, p99 TTFT and TPOT at the client, goodput (requests/s meeting both targets, the
`pdserve bench --goodput` definition), and the coordinator's median |predicted - actual| TTFT
as a fraction of actual (SLO control only).
Usage: .venv/bin/python -m benchmarks.slo [--num-prompts 96] [--input-len 128] [--output-len 32] [--load 2]
The machine should be otherwise idle (about 6 minutes on 2 cores with the default model).
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from types import SimpleNamespace

from pdserve.bench.metrics import compute_metrics
from pdserve.bench.runner import run_rates
from pdserve.bench.workloads import build_requests
from pdserve.common.heap import freeze_startup_heap
from pdserve.common.tokenizer import load_tokenizer
from pdserve.launch import Launcher, NodePlan
from pdserve.ports import free_port
from pdserve_client.library import Client


def bench_args(base_url: str, num: int) -> SimpleNamespace:
    return SimpleNamespace(backend="pdserve", base_url=base_url, extra_body=None, temperature=0.0, top_p=1.0, top_k=-1,
                           ignore_eos=True, request_timeout=600.0, model=None, endpoint=None, warmup=2, max_concurrency=None,
                           seed=0, burstiness=1.0, disable_tqdm=True, num_prompts=num)


def serve_and_measure(args, requests, tokenizer, mode: str, rate: float):
    """Launch one cluster, send the requests at `rate`, return (metrics, coordinator stats)."""
    slo = ["--slo", "--ttft-p99-ms", str(args.ttft_ms), "--tpot-p99-ms", str(args.tpot_ms)]
    coordinator_args = slo if mode.endswith("+slo") else ["--no-slo"]
    counts = {"prefill": 0, "decode": 0, "colocated": 1} if mode.startswith("colocated") else {}
    plan = NodePlan(**counts, model=args.model, client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                    engine_args=["--kv-cache-mb", "256"], name="slo-bench", coordinator_args=coordinator_args)
    launcher = Launcher(plan, log_dir=tempfile.mkdtemp(prefix="pdserve-slo-bench-"))
    launcher.start()
    try:
        launcher.wait_ready()
        [(_, outputs, duration)] = asyncio.run(run_rates(bench_args(plan.client_addr, len(requests)), requests, tokenizer, [rate]))
        with Client(plan.client_addr) as c:
            stats = c.stats()
    finally:
        launcher.stop()
    return compute_metrics(outputs, duration, {"ttft": args.ttft_ms, "tpot": args.tpot_ms}, None), outputs, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--load", type=float, default=2.0, help="offered rate as a multiple of the measured disaggregated capacity")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-ms", type=float, default=250.0)
    ap.add_argument("--modes", default="disaggregated+slo,disaggregated,colocated+slo,colocated", help="which of the four runs")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    requests = build_requests("random", tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0, 0, None)
    freeze_startup_heap()

    burst = requests[: min(32, len(requests))]
    m, _, _ = serve_and_measure(args, burst, tokenizer, "disaggregated", float("inf"))
    capacity = m.completed / m.duration
    rate = args.load * capacity
    print(f"disaggregated capacity {capacity:.2f} req/s ({len(burst)} at once); offered {rate:.2f} req/s Poisson, "
          f"{args.num_prompts} requests x ({args.input_len} in + {args.output_len} out); targets TTFT {args.ttft_ms:g} ms, "
          f"TPOT {args.tpot_ms:g} ms", flush=True)
    print(f"{'mode':34s} {'served':>6s} {'shed':>5s} {'failed':>6s} {'p99 TTFT ms':>11s} {'p99 TPOT ms':>11s} "
          f"{'goodput req/s':>13s} {'TTFT pred err p50':>17s}")
    for mode, label in (("disaggregated+slo", "disaggregated 1P+1D, SLO control"), ("disaggregated", "disaggregated 1P+1D, no SLO control"),
                        ("colocated+slo", "colocated (all cores), SLO control"), ("colocated", "colocated (all cores), no SLO control")):
        if mode not in args.modes.split(","):
            continue
        m, outputs, stats = serve_and_measure(args, requests, tokenizer, mode, rate)
        shed = sum(1 for o in outputs if not o.success and "slo_unattainable" in o.error)
        failed = sum(1 for o in outputs if not o.success) - shed
        err = stats["slo"]["ttft_prediction_error"].get("p50")
        err_text = f"{err * 100:.0f}%" if err is not None and mode.endswith("+slo") else "-"
        print(f"{label:34s} {m.completed:6d} {shed:5d} {failed:6d} {m.latency_ms['ttft']['p99']:11.0f} "
              f"{m.latency_ms['tpot']['p99']:11.1f} {m.request_goodput:13.2f} {err_text:>17s}", flush=True)


if __name__ == "__main__":
    main()
