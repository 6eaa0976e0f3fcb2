"""`scripts/vs_vllm`: pdserve against vLLM's CPU build on this machine: same model, same client,
same workloads, one run, one server at a time.

Lifecycle: build the workloads once (random whole-word prompts of --input-len tokens, greedy,
ignore_eos, --output-len tokens each): one stream (--stream-requests requests, one at a time),
then every --bursts size sent at once. Then for each server row in turn: start it, wait until it
answers, warm it up with two short requests, run every workload through the same OpenAI
streaming client (`/v1/completions`, usage counted from the stream), stop it. Rows:
- `vllm`: `peers/vllm_cpu.sh serve` (vLLM CPU 0.32.0, float32; `setup` is run first if its venv
  is missing: a few minutes);
- `llamacpp`: `peers/llama_cpp.sh serve` (llama.cpp's server on the GGUF as shipped, 32 slots;
  `setup` builds it first if missing: about 6 minutes);
- `colocated`, `disagg`: `pdserve launch` (one colocated worker; 1 prefill + 1 decode), with
  the gateway, SLO control off (`--no-slo`: a throughput comparison, nothing shed), weights
  served quantized as the GGUF ships them (a lone stream's rows with int16 activations, the
  default); `colocated-int8` and `colocated-qfloat` run them with `--quant-activations int8` /
  `float`;
  `colocated-fp32`, `disagg-fp32` dequantize to float32 (`--quantization none`). Each pdserve
  row also reports its workers' resident memory (VmRSS) after the workloads;
- `colocated-slo`, `disagg-slo`: the same with default settings (SLO control on), first burst
  only: whether a burst is served without shedding;
- `hf-batch`: HF transformers `generate` in this process, one static batch per workload.
Prints per workload: requests served, output tok/s, TTFT p50/p99, mean TPOT and every row's
ratio to vLLM (and each pdserve row's TPOT to llama.cpp's, where that row ran), with the issue's goals; start-up seconds (process start to first answer) per
server. `--save-result` writes every figure as JSON. Servers start and stop as in benchmarks/servers.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

from benchmarks.machine import machine, resident_mib
from benchmarks.servers import PEERS, Workload, add_peers_flag, peer_row, report_errors, run_workloads
from pdserve.ports import free_port

ROWS = ("vllm", "llamacpp", "colocated", "disagg", "colocated-int8", "colocated-qfloat", "colocated-fp32", "disagg-fp32", "colocated-slo", "disagg-slo",
        "hf-batch")
ROW_NAMES = {"vllm": PEERS["vllm"].name, "llamacpp": PEERS["llamacpp"].name, "colocated": "pdserve colocated",
             "disagg": "pdserve disagg 1P+1D", "colocated-int8": "pdserve coloc int8-act", "colocated-qfloat": "pdserve coloc float-act",
                 "colocated-fp32": "pdserve colocated fp32",
             "disagg-fp32": "pdserve disagg fp32", "colocated-slo": "pdserve colocated, SLO on", "disagg-slo": "pdserve disagg, SLO on",
             "hf-batch": "HF static batch"}
# pdserve rows: the weights as the GGUF ships them (default --quantization auto; small decode
# batches with int16 activations, the default, or int8 or float ones), or dequantized to float32
# (--quantization none)
ROW_ENGINE_ARGS = {"-int8": ["--quant-activations", "int8"], "-qfloat": ["--quant-activations", "float"], "-fp32": ["--quantization", "none"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/vs_vllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="pdserve's model (default: SmolLM2-135M-Instruct GGUF); vLLM gets its HF copy")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--bursts", default="32,64", help='request counts sent all at once ("": none, the single stream alone)')
    ap.add_argument("--stream-requests", type=int, default=4, help="requests of the single-stream workload (0: skip it)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    add_peers_flag(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", default=None, metavar="FILE.json")
    return ap


def pdserve_row(args, row: str, workloads, tokenizer, log_dir: str, memory: dict) -> tuple[dict, float]:
    from pdserve.launch import Launcher, NodePlan

    counts = dict(prefill=0, decode=0, colocated=1) if row.startswith("colocated") else dict(prefill=1, decode=1)
    slo = row.endswith("-slo")
    engine_args = next((a for suffix, a in ROW_ENGINE_ARGS.items() if row.endswith(suffix)), [])
    plan = NodePlan(**counts, coordinator=True, gateway=True, model=args.model, name="vs", http_port=free_port(),
                    client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                    coordinator_args=[] if slo else ["--no-slo"], engine_args=list(engine_args))
    t0 = time.perf_counter()
    launcher = Launcher(plan, log_dir=os.path.join(log_dir, row))
    launcher.start()
    try:
        launcher.wait_ready(timeout=600)
        startup = time.perf_counter() - t0
        result = run_workloads(plan.http_url, workloads, tokenizer), startup
        memory[row] = {name: resident_mib(proc.pid) for name, proc in launcher.procs
                       if name.split("-")[0] in ("prefill", "decode", "colocated")}
        return result
    finally:
        launcher.stop()


def hf_row(args, workloads) -> dict:
    from benchmarks.hf import hf_generate, hf_run, load_hf

    model = load_hf(args.model, os.cpu_count() or 1)
    hf_generate(model, [workloads[0].requests[0].token_ids[:8]], 2, 0)  # warm-up
    return {w.name: hf_run(model, w.requests, w.max_concurrency == 1, 0) for w in workloads}


def format_tables(metrics: dict, startups: dict, workloads, memory: dict | None = None) -> str:
    lines = []
    for w in workloads:
        base = metrics.get("vllm", {}).get(w.name)
        head = f"{w.name:22s} {'ok':>7s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT mean':>10s}  vs vLLM"
        lines += ["", head, "-" * (len(head) + 24)]
        for row in ROWS:
            m = metrics.get(row, {}).get(w.name)
            if m is None:
                continue
            lat = m.latency_ms
            ratio = ""
            if base is not None and row != "vllm" and base.output_throughput > 0:
                ratio = (f"{m.output_throughput / base.output_throughput:.2f}x tok/s, "
                         f"p99 TTFT {lat['ttft']['p99'] / max(base.latency_ms['ttft']['p99'], 1e-9):.2f}x, "
                         f"TPOT {lat['tpot']['mean'] / max(base.latency_ms['tpot']['mean'], 1e-9):.2f}x")
            cpp = metrics.get("llamacpp", {}).get(w.name)
            if cpp is not None and row not in ("vllm", "llamacpp") and cpp.latency_ms["tpot"]["mean"] > 0:  # the lone-stream goal's ratio
                ratio += f"{', ' if ratio else ''}TPOT {lat['tpot']['mean'] / cpp.latency_ms['tpot']['mean']:.2f}x llama.cpp's"
            lines.append(f"{ROW_NAMES[row]:22s} {m.completed:3d}/{m.completed + m.failed:<3d} {m.output_throughput:10.1f} "
                         f"{lat['ttft']['median']:9.0f} {lat['ttft']['p99']:9.0f} {lat['tpot']['mean']:10.1f}  {ratio}")
    lines += ["", "start-up, process start to first answer (s): "
              + ", ".join(f"{ROW_NAMES[r]} {s:.1f}" for r, s in startups.items())]
    if memory:
        lines.append("worker resident memory after the workloads (MiB): " + "; ".join(
            f"{ROW_NAMES[r]}: " + ", ".join(f"{n} {v:.0f}" for n, v in procs.items() if v is not None) for r, procs in memory.items()))
    lines.append("goals: colocated >= 1.0x vLLM tok/s at every burst, disagg >= 0.8x, single-stream TPOT <= vLLM's, "
                 "p99 TTFT <= vLLM's; SLO-on rows: every request served; quantized: single-stream TPOT <= 0.6x llama.cpp's, "
                 "32-request tok/s >= the fp32 row's")
    return "\n".join(lines)


def burst_sizes(text: str) -> list[int]:
    """--bursts: request counts, comma-separated; "" runs the single-stream workload alone."""
    return [int(b) for b in text.split(",") if b.strip()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        print(f"scripts/vs_vllm: unknown row {', '.join(bad)}", file=sys.stderr)
        return 2
    from pdserve.bench.metrics import compute_metrics
    from pdserve.bench.workloads import build_requests
    from pdserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workloads = []
    if args.stream_requests:
        reqs = build_requests("random", tokenizer, args.stream_requests, args.input_len, args.output_len, 0.0, args.seed)
        workloads.append(Workload("1 stream", reqs, 1))
    for n in burst_sizes(args.bursts):
        workloads.append(Workload(f"{n} at once", build_requests("random", tokenizer, n, args.input_len, args.output_len, 0.0,
                                                                  args.seed + n), None))
    print(f"machine: {machine()}")
    print(f"workloads: {args.input_len} prompt + {args.output_len} output tokens (random words), greedy, ignore_eos; "
          f"{', '.join(w.name for w in workloads)}; client: OpenAI /v1/completions streaming")
    print(f"reproduce: scripts/vs_vllm {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(), flush=True)
    log_dir = tempfile.mkdtemp(prefix="pdserve-vs-vllm-")
    results, startups, memory = {}, {}, {}
    for row in rows:
        print(f"running {ROW_NAMES[row]} ...", file=sys.stderr, flush=True)
        mine = workloads[1:2] if row.endswith("-slo") and len(workloads) > 1 else workloads
        if row in PEERS:
            results[row], startups[row] = peer_row(args, row, mine, tokenizer, log_dir)
        elif row == "hf-batch":
            results[row] = hf_row(args, mine)
        else:
            results[row], startups[row] = pdserve_row(args, row, mine, tokenizer, log_dir, memory)
        report_errors(ROW_NAMES[row], results[row])
    metrics = {row: {name: compute_metrics(outs, dur) for name, (outs, dur) in r.items()} for row, r in results.items()}
    print(format_tables(metrics, startups, workloads, memory))
    print(f"(server logs in {log_dir})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "startup_s": startups, "resident_mib": memory,
                       "rows": {row: {n: dataclasses.asdict(m) for n, m in ms.items()} for row, ms in metrics.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
