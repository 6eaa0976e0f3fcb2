"""`scripts/compare`: one workload against pdserve and what users would pick instead, one table.

Lifecycle: build the workload once (`random` prompts of whole-word tokens, so that token-id and
text backends get identical prompts; greedy; every request runs to its output length) -> run
each row in turn, alone on the machine: pdserve disaggregated (1 prefill + 1 decode) and
colocated (each a `Launcher` started, warmed up, measured through the msgspec client, stopped),
HF transformers `generate` one request at a time and as one static left-padded batch
(in-process, token times from a streamer), and llama.cpp's OpenAI server on the same GGUF when
`llama-cpp-python` is installed -> print the table with each row's output throughput as a
ratio to pdserve disaggregated -> then the micro-benchmarks: the decode-step roofline on the
decode worker's threads, the coordinator's overhead with stub workers, the shm and tcp KV
hand-off. `--save-result` writes every figure as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.machine import machine
from pdserve.ports import free_port

ROWS = ("disagg", "colocated", "hf-serial", "hf-batch", "llama-cpp")
SECTIONS = ("rows", "roofline", "overhead", "kv")
ROW_NAMES = {"disagg": "pdserve disaggregated 1P+1D", "colocated": "pdserve colocated", "hf-serial": "HF generate, one at a time",
             "hf-batch": "HF generate, static batch", "llama-cpp": "llama.cpp server"}
GOALS = {"hf-serial": 10.0, "hf-batch": 2.0, "llama-cpp": 5.0}  # pdserve disaggregated throughput at least this many times the row's


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: --model if it is a GGUF)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per pdserve worker (default: cores / workers)")
    ap.add_argument("--kv-backend", default="auto", choices=("auto", "shm", "tcp"))
    ap.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    ap.add_argument("--overhead-requests", type=int, default=20000)
    ap.add_argument("--kv-tokens", default="128,1024", help="prompt sizes for the KV hand-off")
    ap.add_argument("--save-result", default=None, metavar="FILE.json")
    ap.add_argument("--disable-tqdm", action="store_true")
    return ap


def resolve_gguf(args) -> Path | None:
    from pdserve.common.model_path import resolve_model_path

    path = Path(args.gguf) if args.gguf else resolve_model_path(args.model)
    return path if path.is_file() and path.suffix == ".gguf" else None


def warmup(requests, n: int) -> list:
    """n short copies of the first requests: the first forward passes allocate and are slow."""
    import dataclasses

    return [dataclasses.replace(r, output_len=min(4, r.output_len)) for r in requests[:n]]


# ------------------------------------------------------------------ pdserve rows

def pdserve_row(args, requests, mode: str, log_dir: str):
    from pdserve.bench.backends import PdserveBackend, Sampling
    from pdserve.bench.runner import send_all
    from pdserve.launch import Launcher, NodePlan

    counts = dict(prefill=0, decode=0, colocated=1) if mode == "colocated" else dict(prefill=1, decode=1)
    plan = NodePlan(**counts, model=args.model, kv_backend=args.kv_backend, threads=args.threads, name="cmp",
                    client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                    engine_args=["--max-num-seqs", str(max(64, len(requests)))],
                    coordinator_args=["--no-slo"])  # a throughput comparison: every request is served, none shed
    launcher = Launcher(plan, log_dir=os.path.join(log_dir, mode))
    launcher.start()
    try:
        launcher.wait_ready(timeout=600)

        async def go():
            async with PdserveBackend(plan.client_addr, Sampling(ignore_eos=True), 3600.0) as b:
                await send_all(b, warmup(requests, 2), float("inf"), 1.0, None, 0, False)
                return await send_all(b, requests, float("inf"), 1.0, None, 0, not args.disable_tqdm, ROW_NAMES[mode])

        return asyncio.run(go())
    finally:
        launcher.stop()


# ------------------------------------------------------------------ HF transformers rows

def hf_rows(args, requests, rows: list[str], pad_id: int) -> dict:
    from benchmarks.hf import hf_generate, hf_run, load_hf

    model = load_hf(args.model, os.cpu_count() or 1)
    hf_generate(model, [requests[0].token_ids[:8]], 2, pad_id)  # warm-up
    return {row: hf_run(model, requests, row == "hf-serial", pad_id) for row in ("hf-serial", "hf-batch") if row in rows}


# ------------------------------------------------------------------ llama.cpp row

def llama_cpp_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (.venv/bin/pip install 'llama-cpp-python[server]'; it compiles llama.cpp)"
    if importlib.util.find_spec("llama_cpp.server") is None or importlib.util.find_spec("uvicorn") is None:
        return "llama-cpp-python is installed without its server extra (pip install 'llama-cpp-python[server]')"
    return None


def llama_cpp_row(args, requests, tokenizer, gguf: Path, log_dir: str):
    from benchmarks.servers import wait_http
    from pdserve.bench.backends import OpenAIBackend, Sampling
    from pdserve.bench.runner import send_all

    port = free_port()
    n_ctx = max(r.prompt_len + r.output_len for r in requests) + 64
    # --interrupt_requests False: by default the server cuts every stream but the newest after one token.
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "False"]
    log = open(os.path.join(log_dir, "llama-cpp.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        # repeat_penalty 1.0: its default is 1.1, which changes the work and the output.
        sampling = Sampling(ignore_eos=True, extra_body={"repeat_penalty": 1.0})

        async def go():
            async with OpenAIBackend(f"http://127.0.0.1:{port}", "/v1/completions", None, sampling, 3600.0, chat=False,
                                     tokenizer=tokenizer) as b:  # counts the tokens if its stream carries no usage
                await send_all(b, warmup(requests, 1), float("inf"), 1.0, None, 0, False)
                return await send_all(b, requests, float("inf"), 1.0, None, 0, not args.disable_tqdm, ROW_NAMES["llama-cpp"])

        return asyncio.run(go())
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ------------------------------------------------------------------ table

def format_table(metrics: dict, skipped: dict) -> str:
    base = metrics.get("disagg")
    head = (f"{'row':30s} {'ok':>7s} {'dur s':>8s} {'out tok/s':>10s} {'TTFT ms':>9s} {'p99 TTFT':>9s} {'TPOT ms':>8s} "
            f"{'p99 TPOT':>9s}  {'pdserve disagg is':s}")
    lines = [head, "-" * len(head)]
    for key in ROWS:
        if key in skipped:
            lines.append(f"{ROW_NAMES[key]:30s} skipped: {skipped[key]}")
            continue
        m = metrics.get(key)
        if m is None:
            continue
        lat = m.latency_ms
        ratio = ""
        if base is not None and m.output_throughput > 0:
            r = base.output_throughput / m.output_throughput
            ratio = f"{r:.2f}x"
            if key in GOALS:
                ratio += f" (goal >= {GOALS[key]:g}x: " + ("met)" if r >= GOALS[key] else f"MISSED by {GOALS[key] / r:.2f}x)")
        lines.append(f"{ROW_NAMES[key]:30s} {m.completed:3d}/{m.completed + m.failed:<3d} {m.duration:8.2f} {m.output_throughput:10.1f} "
                     f"{lat['ttft']['mean']:9.1f} {lat['ttft']['p99']:9.1f} {lat['tpot']['mean']:8.1f} {lat['tpot']['p99']:9.1f}  {ratio}")
    return "\n".join(lines)


def run_rows(args, requests, tokenizer, rows: list[str], log_dir: str) -> tuple[dict, dict]:
    from pdserve.bench.metrics import compute_metrics

    results, skipped = {}, {}
    for mode in ("disagg", "colocated"):
        if mode in rows:
            results[mode] = pdserve_row(args, requests, mode, log_dir)
    if "hf-serial" in rows or "hf-batch" in rows:
        results.update(hf_rows(args, requests, rows, tokenizer.eos_token_id or 0))
    if "llama-cpp" in rows:
        gguf = resolve_gguf(args)
        why = llama_cpp_missing() or (None if gguf else "no GGUF to give it (pass --gguf FILE)")
        if why:
            skipped["llama-cpp"] = why
        else:
            results["llama-cpp"] = llama_cpp_row(args, requests, tokenizer, gguf, log_dir)
    metrics = {k: compute_metrics(outs, dur) for k, (outs, dur) in results.items()}
    for k, (outs, _) in results.items():
        errors = sorted({o.error for o in outs if not o.success})
        if errors:
            print(f"{ROW_NAMES[k]}: {len(errors)} kind(s) of error, first: {errors[0]}", file=sys.stderr)
    return metrics, skipped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    sections = [s for s in args.sections.split(",") if s]
    bad = [r for r in rows if r not in ROWS] + [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"scripts/compare: unknown row or section: {', '.join(bad)}", file=sys.stderr)
        return 2
    from pdserve.bench.workloads import build_requests
    from pdserve.common.tokenizer import load_tokenizer

    cores = os.cpu_count() or 1
    decode_threads = args.threads or cores  # a launched decode worker gets every core while the prefill worker idles (runtime.cores)
    print(f"machine: {machine()}")
    print(f"workload: {args.num_prompts} requests x {args.input_len} prompt + {args.output_len} output tokens (random words, "
          f"range ratio {args.range_ratio}), greedy, ignore_eos, all sent at once; float32; "
          f"model {args.model or 'default (SmolLM2-135M-Instruct)'}")
    print(f"reproduce: scripts/compare {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    tokenizer = load_tokenizer(args.model)
    requests = build_requests("random", tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    saved = {"machine": machine(), "args": vars(args)}
    log_dir = tempfile.mkdtemp(prefix="pdserve-compare-")
    if "rows" in sections and rows:
        metrics, skipped = run_rows(args, requests, tokenizer, rows, log_dir)
        print(format_table(metrics, skipped))
        saved["rows"] = {k: asdict(m) for k, m in metrics.items()}
        saved["skipped"] = skipped
    micro_benchmarks(args, sections, decode_threads, saved)
    print(f"(worker logs in {log_dir})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(saved, f, indent=1, default=str)
    return 0


def micro_benchmarks(args, sections: list[str], threads: int, saved: dict) -> None:
    from benchmarks import roofline as rl

    if "roofline" in sections:
        r = rl.decode_roofline(args.model, threads, batch=args.num_prompts, prompt_len=args.input_len)
        print(rl.format_roofline(r))
        saved["roofline"] = {**asdict(r), "fraction": r.fraction, "memory_s": r.memory_s, "compute_s": r.compute_s}
    if "overhead" in sections:
        from pdserve.bench.overhead import format_overhead, measure_overhead

        o = measure_overhead(args.model, args.overhead_requests, 256, min(2000, args.overhead_requests), log=subprocess.DEVNULL)
        print(format_overhead(o))
        saved["overhead"] = o
    if "kv" in sections:
        from pdserve.runtime.weights import load_checkpoint

        cfg, _ = load_checkpoint(args.model, progress=False)
        rows = [h for n in args.kv_tokens.split(",") for h in rl.kv_handoff(cfg, int(n), threads)]
        print(rl.format_handoffs(rows, threads))
        saved["kv"] = [{**asdict(h), "gbps": h.gbps, "memcpy_gbps": h.memcpy_gbps} for h in rows]


if __name__ == "__main__":
    sys.exit(main())
