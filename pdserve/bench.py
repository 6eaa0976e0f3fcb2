"""`pdserve bench`: the serving benchmark, modelled on `vllm bench serve` (same flags, same report).

Lifecycle of one run: parse the flags -> load the tokenizer and build every request up front
(`bench_data`) -> open the backend (`bench_backends`: the pdserve msgspec client, or any
OpenAI-compatible HTTP server) -> send `--warmup` untimed requests -> send the requests at
`--request-rate` (inf: all at once; else Poisson, or gamma with `--burstiness`), at most
`--max-concurrency` in flight, a progress bar counting completions -> reduce the per-request
timings to vLLM's figures (`bench_metrics`), print them, optionally save them as JSON.
`--sweep R1,R2,...` repeats the run at each rate and draws p99 TTFT, p99 TPOT and goodput
against rate into a PNG. `--stub-coordinator` measures the coordinator alone instead
(`bench_overhead`). Only the standard library is imported at module load; the CLI stays fast.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime

from runtime.heap import freeze_startup_heap

DEFAULT_PLOT = "bench-sweep.png"


def build_parser() -> argparse.ArgumentParser:
    from pdserve.bench_backends import BACKENDS
    from pdserve.bench_vllm import DATASETS, add_vllm_flags

    ap = argparse.ArgumentParser(prog="pdserve bench", description="Benchmark online serving latency and throughput "
                                 "(flags and report follow `vllm bench serve`).")
    ap.add_argument("--backend", default=None, choices=(*BACKENDS, "vllm"),
                    help="pdserve: the msgspec client; openai(-chat): any OpenAI-compatible server (vllm: openai); "
                         "default: openai given an http URL, --host or --port, else pdserve")
    ap.add_argument("--base-url", default=None, help="tcp://127.0.0.1:5555 (pdserve) or http://127.0.0.1:8000 (openai)")
    ap.add_argument("--endpoint", default=None, help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    ap.add_argument("--model", default=None, help="model name sent to an OpenAI server (default: its first /v1/models entry)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (GGUF file or HF dir; default: the default model's)")
    ap.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS,
                    help="sharegpt, custom: the same reader as jsonl")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT-style JSONL or JSON array (default: the prompt set shipped in pdserve/data)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128, help="random: prompt tokens")
    ap.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                    help="output tokens (random default 128; jsonl default: each reply's length)")
    ap.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                    help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 = Poisson, <1 burstier, >1 steadier")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--extra-body", default=None, help="openai: JSON merged into every request, e.g. '{\"repeat_penalty\": 1.0}'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", "--num-warmups", dest="warmup", type=int, default=0, help="untimed requests sent first")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. --goodput ttft:500 tpot:50 (ttft, tpot, e2el)")
    ap.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE.json",
                    help="alone (vLLM's form): write vLLM's result file (see --result-dir, --result-filename); with a path: "
                         "everything, per-request lists included, to that file")
    ap.add_argument("--sweep", default=None, metavar="RATE,RATE,...", help="run at each request rate; plot p99 TTFT, p99 TPOT, goodput")
    ap.add_argument("--plot", default=DEFAULT_PLOT, help=f"--sweep's PNG (default {DEFAULT_PLOT})")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--stub-coordinator", action="store_true",
                    help="measure coordinator overhead: a real coordinator, stub workers that answer at once, "
                         "--num-prompts requests with --max-concurrency in flight")
    add_vllm_flags(ap)
    return ap


# ------------------------------------------------------------------ one run

async def send_all(backend, requests, rate: float, burstiness: float, max_concurrency: int | None, seed: int, progress: bool,
                   desc: str = "requests", tokenizer=None):
    """Send every request on its arrival schedule; returns (outputs in request order, seconds).
    A conversation (chat_replay: `next_turns`) sends its later turns one after the other, each
    once the previous answer is in; their outputs follow the first turn's."""
    from tqdm import tqdm

    from pdserve.bench_data import arrival_intervals, follow_up

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=sum(1 + len(r.next_turns) for r in requests), desc=desc, disable=not progress, file=sys.stderr)
    t0 = time.perf_counter()

    async def one(req):
        if sem is not None:
            await sem.acquire()
        try:
            start = time.perf_counter() - t0
            out = await backend.request(req)
            out.start_time = start
        finally:
            if sem is not None:
                sem.release()
        bar.update(1)
        return out

    async def conversation(req):
        outs = [await one(req)]
        while req.next_turns and outs[-1].success:
            req = follow_up(tokenizer, req, outs[-1].generated_text)
            outs.append(await one(req))
        return outs

    tasks = []
    for req, gap in zip(requests, arrival_intervals(len(requests), rate, burstiness, seed)):
        tasks.append(asyncio.ensure_future(conversation(req)))
        if gap > 0:
            await asyncio.sleep(gap)
    outputs = [o for outs in await asyncio.gather(*tasks) for o in outs]
    duration = time.perf_counter() - t0
    bar.close()
    return outputs, duration


async def run_rates(args, requests, tokenizer, rates: list[float]) -> list[tuple]:
    """Open the backend once, warm up, then one timed run per rate: [(rate, outputs, seconds)]."""
    from pdserve.bench_backends import Sampling, make_backend

    extra = json.loads(args.extra_body) if args.extra_body else {}
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.ignore_eos, extra)
    backend = make_backend(args.backend, args.base_url, sampling, args.request_timeout, getattr(args, "served_model_name", None) or args.model,
                           args.endpoint, tokenizer)
    runs = []
    args.kv_moved = []  # per rate: the pdserve cluster's KV hand-off and prefix-cache figures (kv_counters), or None
    async with backend:
        args.model_id = args.model or getattr(backend, "model", None)  # an OpenAI server's first model when not given
        if args.warmup:
            warm, _ = await send_all(backend, [requests[i % len(requests)] for i in range(args.warmup)], float("inf"), 1.0,
                                     args.max_concurrency, args.seed, not args.disable_tqdm, "warm-up")
            failed = [o.error for o in warm if not o.success]
            if len(failed) == len(warm):
                raise RuntimeError(f"every warm-up request failed; first error: {failed[0]}")
        for rate in rates:
            before = await kv_counters(backend)
            outputs, duration = await send_all(backend, requests, rate, args.burstiness, args.max_concurrency, args.seed,
                                               not args.disable_tqdm, tokenizer=tokenizer)
            after = await kv_counters(backend)
            args.kv_moved.append({k: after[k] - before[k] for k in after} if before and after else None)
            runs.append((rate, outputs, duration))
    return runs


async def kv_counters(backend, settle_s: float = 5.0) -> dict | None:
    """pdserve backend: the coordinator's KV hand-off bytes and count and its workers' prefix-cache
    tokens looked up and hit (the run's figures are the differences); None for other backends.

    The prefix-cache counters reach the coordinator in worker heartbeats (every 0.5 s by default),
    so a run shorter than a heartbeat would read stale figures: this waits (up to settle_s) until
    every worker has sent two more heartbeats, the second of which was built after this call."""
    client = getattr(backend, "client", None)
    if not hasattr(client, "stats"):
        return None
    s = await client.stats(timeout=10.0)
    seen = {w["id"]: w.get("heartbeats", 0) for w in s.get("workers", [])}
    deadline = asyncio.get_running_loop().time() + settle_s
    while any(w.get("heartbeats", 0) < seen.get(w["id"], 0) + 2 for w in s.get("workers", [])):
        if asyncio.get_running_loop().time() > deadline:
            break  # a worker that stopped beating: report what the coordinator has
        await asyncio.sleep(0.05)
        s = await client.stats(timeout=10.0)
    caches = [w.get("prefix_cache", {}) for w in s.get("workers", [])]
    return {"kv_handoff_bytes": s["kv_transfer"]["bytes"], "kv_handoffs": s["kv_transfer"]["handoffs"],
            "prefix_cache_queries": sum(c.get("queries", 0) for c in caches), "prefix_cache_hits": sum(c.get("hits", 0) for c in caches)}


# ------------------------------------------------------------------ the command

def load_bench_tokenizer(args):
    from pathlib import Path

    from runtime.tokenizer import load_tokenizer

    path = args.tokenizer or (args.model if args.model and Path(args.model).exists() else None)
    return load_tokenizer(path), path or "default"


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep takes positive rates separated by commas (inf allowed), got {text!r}")
    return rates


def config_dict(args, tokenizer_id: str, rate: float) -> dict:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "base_url": args.base_url, "model_id": args.model,
        "tokenizer_id": tokenizer_id, "dataset": args.dataset, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "request_rate": rate if rate != float("inf") else "inf", "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "seed": args.seed,
    }


def describe_traffic(args, rate: float) -> str:
    kind = "Poisson process" if args.burstiness == 1.0 else "gamma distribution"
    return (f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness} ({kind})\n"
            f"Maximum request concurrency: {args.max_concurrency}")


def report(args, runs, tokenizer_id: str) -> list[dict]:
    from pdserve.bench_metrics import compute_metrics, format_metrics, parse_goodput, result_dict

    slos = parse_goodput(args.goodput)
    results = []
    for i, (rate, outputs, duration) in enumerate(runs):
        m = compute_metrics(outputs, duration, slos, args.max_concurrency, args.metrics, args.percentiles)
        print(describe_traffic(args, rate))
        print(format_metrics(m))
        moved = (getattr(args, "kv_moved", None) or [None] * len(runs))[i]
        if moved:
            rate_hit = moved["prefix_cache_hits"] / moved["prefix_cache_queries"] if moved["prefix_cache_queries"] else 0.0
            print(f"KV hand-offs: {moved['kv_handoffs']}, {moved['kv_handoff_bytes']} bytes; prefix cache hit rate {rate_hit:.1%} "
                  f"({moved['prefix_cache_hits']} of {moved['prefix_cache_queries']} prompt tokens, all workers)")
        errors = sorted({o.error for o in outputs if not o.success})
        for e in errors[:5]:
            print(f"error: {e}", file=sys.stderr)
        results.append(result_dict(m, outputs, {**config_dict(args, tokenizer_id, rate), "goodput_slos_ms": slos, **(moved or {})}))
    return results


def plot_sweep(results: list[dict], path: str) -> None:
    """p99 TTFT, p99 TPOT and goodput (request throughput without SLOs) against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["request_rate"]) for r in results]
    x = list(range(len(results)))  # categorical: "inf" has no place on a numeric axis
    slos = results[0]["goodput_slos_ms"]
    good = "goodput (req/s; " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) + ")"
    panels = [("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
              ("request_goodput", good) if slos else ("request_throughput", "throughput (req/s; no --goodput SLOs)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(x, [r[key] for r in results], marker="o")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"pdserve bench: {results[0]['backend']}, {results[0]['num_prompts']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    from pdserve.bench_vllm import resolve

    resolve(args)
    if args.stub_coordinator:
        from pdserve.bench_overhead import run_overhead

        return run_overhead(args)
    from pdserve.bench_vllm import build_workload, save_vllm_result

    rates = parse_rates(args.sweep) if args.sweep else [args.request_rate]
    tokenizer, tokenizer_id = load_bench_tokenizer(args)
    requests = build_workload(args, tokenizer)
    freeze_startup_heap()  # no full-collection pause inside the measured latencies
    runs = asyncio.run(run_rates(args, requests, tokenizer, rates))
    results = report(args, runs, tokenizer_id)
    if args.sweep:
        plot_sweep(results, args.plot)
        print(f"sweep plot written to {args.plot}")
    if args.save_result is True or args.append_result:  # vLLM's form: one file a run, vLLM's keys
        for result in results:
            print(f"result written to {save_vllm_result(args, result, args.model_id, tokenizer_id)}")
    elif args.save_result:
        path = os.path.join(args.result_dir, args.save_result) if args.result_dir else args.save_result
        with open(path, "w") as f:
            json.dump({"sweep": results} if args.sweep else results[0], f, indent=1)
        print(f"result written to {path}")
    return 0 if any(o.success for _, outs, _ in runs for o in outs) else 1


def main(argv: list[str] | None = None) -> int:
    from pdserve_client.errors import PdserveError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, ConnectionError, RuntimeError, PdserveError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
