#!/usr/bin/env python
"""Host-memory KV tier benchmark (issue 41): a multi-turn chat workload whose conversation
prefixes outgrow one worker's KV pool, served with and without the node's host KV tier.

Lifecycle: build one chat_replay workload (`pdserve bench --dataset chat_replay`: a shared system
prompt, then each conversation's turns one after the other, each resending the conversation so
far and the answers) -> launch one colocated worker with a small --kv-cache-mb and
--kv-host-tier-mb 0 (off), send the workload (--max-concurrency requests in flight, so
conversations interleave and evict each other's prefixes between their turns), stop it -> the
same with --kv-host-tier-mb N -> print one table: p50 TTFT over all turns and over the later
turns (those that resend a conversation), the prefix-cache hit rate, and the tier's hit rate
(tokens loaded from it / tokens looked up in it past the prefix cache) and bytes put and loaded,
all from the coordinator's stats (pdserve.bench.runner.kv_counters).
With --engine the same conversations go through one in-process engine instead (no server, one
request at a time, so TTFT is the prefill's own time: the tier's effect without queueing noise).
Usage: .venv/bin/python -m benchmarks.host_tier [--conversations 8] [--turns 4] [--kv-cache-mb 96] [--tier-mb 512] [--rounds 2] [--engine]
The machine should be otherwise idle (a few minutes on 2 cores with the default model).
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from pdserve.bench.runner import run_rates
from pdserve.bench.workloads import chat_replay_requests, follow_up
from pdserve.common.tokenizer import load_tokenizer
from pdserve.launch import Launcher, NodePlan
from pdserve.ports import free_port


def bench_args(base_url: str, num: int, concurrency: int) -> SimpleNamespace:
    return SimpleNamespace(backend="pdserve", base_url=base_url, extra_body=None, temperature=0.0, top_p=1.0, top_k=-1,
                           ignore_eos=True, request_timeout=900.0, model=None, endpoint=None, warmup=0, max_concurrency=concurrency,
                           seed=0, burstiness=1.0, disable_tqdm=True, num_prompts=num)


def serve_and_measure(args, requests, tokenizer, tier_mb: int) -> dict:
    """Launch one colocated worker with the tier at tier_mb (0: off), send the conversations, return the figures."""
    engine_args = ["--kv-cache-mb", str(args.kv_cache_mb), "--kv-host-tier-mb", str(tier_mb)]
    plan = NodePlan(prefill=0, decode=0, colocated=1, model=args.model, client_addr=f"tcp://127.0.0.1:{free_port()}",
                    worker_addr=f"tcp://127.0.0.1:{free_port()}", engine_args=engine_args, name="tier-bench",
                    coordinator_args=["--no-slo"])
    launcher = Launcher(plan, log_dir=tempfile.mkdtemp(prefix="pdserve-tier-bench-"))
    launcher.start()
    try:
        launcher.wait_ready()
        bargs = bench_args(plan.client_addr, len(requests), args.concurrency)
        [(_, outputs, duration)] = asyncio.run(run_rates(bargs, requests, tokenizer, [float("inf")]))
        moved = bargs.kv_moved[0]
    finally:
        launcher.stop()
    ok = [o for o in outputs if o.success]
    later = [o for i, o in enumerate(outputs) if i % args.turns and o.success]  # conversations' outputs are contiguous, in turn order
    print(f"tier {tier_mb} MiB: TTFT ms by request {[round(1000 * o.ttft) for o in outputs]}", flush=True)
    q, h = moved["prefix_cache_queries"], moved["prefix_cache_hits"]
    tq, th = moved["host_tier_queries"], moved["host_tier_hits"]
    return {"ok": f"{len(ok)}/{len(outputs)}", "p50_ttft_ms": 1000 * float(np.median([o.ttft for o in ok])),
            "p50_later_ttft_ms": 1000 * float(np.median([o.ttft for o in later])), "duration_s": duration,
            "prefix_hit_rate": h / q if q else 0.0, "tier_hit_rate": th / tq if tq else 0.0, "tier_hits": th, "tier_queries": tq,
            "tier_mb_in": moved["host_tier_bytes_in"] / 2**20, "tier_mb_out": moved["host_tier_bytes_out"] / 2**20}


def engine_measure(args, requests, tokenizer, tier_mb: int, eng) -> dict:
    """--engine: the same conversations through one in-process engine (no server, one request at
    a time, turn after turn of every conversation), its prefix cache emptied first; TTFT is the
    time from add_request to the step that samples the first token."""
    from pdserve.kvtransfer import host_tier
    from pdserve.runtime.config import EngineConfig
    from pdserve_client.params import SamplingParams

    eng.blocks.reset_prefix_cache()
    tier = host_tier.attach(eng, EngineConfig(kv_host_tier_bytes=tier_mb * 2**20), args.model)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    q0, h0, ttft, later, t0 = eng.blocks.queries, eng.blocks.hits, [], [], time.perf_counter()
    current = list(requests)
    for turn in range(args.turns):
        for i, req in enumerate(current):
            start = time.perf_counter()
            seq = eng.add_request(req.token_ids, params)
            while not seq.output_token_ids:
                eng.step()
            (later if turn else ttft).append(time.perf_counter() - start)
            while not seq.finished:
                eng.step()
            if req.next_turns:
                current[i] = follow_up(tokenizer, req, tokenizer.decode(seq.output_token_ids))
    link = eng.blocks.tier
    eng.blocks.tier = None
    if tier is not None:
        tier.close()
    q, h = eng.blocks.queries - q0, eng.blocks.hits - h0
    tq, th = (link.queries, link.hits) if link else (0, 0)
    report = link.report() if link else {"host_tier_bytes_in": 0, "host_tier_bytes_out": 0}
    return {"ok": f"{len(ttft) + len(later)}/{len(requests) * args.turns}", "p50_ttft_ms": 1000 * float(np.median(ttft + later)),
            "p50_later_ttft_ms": 1000 * float(np.median(later)), "duration_s": time.perf_counter() - t0,
            "prefix_hit_rate": h / q if q else 0.0, "tier_hit_rate": th / tq if tq else 0.0, "tier_hits": th, "tier_queries": tq,
            "tier_mb_in": report["host_tier_bytes_in"] / 2**20, "tier_mb_out": report["host_tier_bytes_out"] / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (conversations interleave)")
    ap.add_argument("--kv-cache-mb", type=int, default=96, help="the worker's pool: smaller than the conversations' prefixes")
    ap.add_argument("--tier-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each setting, in ABBA order (off, on, on, off, ...): a drifting load weighs on both alike")
    ap.add_argument("--engine", action="store_true", help="one in-process engine instead of a launched worker (no server, no queueing: "
                    "TTFT is the prefill's time)")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    requests = chat_replay_requests(tokenizer, args.conversations * args.turns, args.turns, args.system_len, args.user_len,
                                    args.output_len, seed=0)
    order = [(0, args.tier_mb) if r % 2 == 0 else (args.tier_mb, 0) for r in range(args.rounds)]
    if args.engine:
        from pdserve.runtime.config import EngineConfig
        from pdserve.runtime.engine import LLMEngine

        eng = LLMEngine.load(args.model, EngineConfig(kv_cache_bytes=args.kv_cache_mb * 2**20), progress=False, tokenizer=False)
        rows = [(mb, engine_measure(args, requests, tokenizer, mb, eng)) for pair in order for mb in pair]
    else:
        rows = [(mb, serve_and_measure(args, requests, tokenizer, mb)) for pair in order for mb in pair]
    where = "one in-process engine, one request at a time" if args.engine else f"{args.concurrency} in flight; one colocated worker"
    print(f"chat_replay: {args.conversations} conversations x {args.turns} turns, system {args.system_len}, user {args.user_len}, "
          f"output {args.output_len} tokens, {where}, --kv-cache-mb {args.kv_cache_mb}")
    print("| --kv-host-tier-mb | ok | p50 TTFT | p50 TTFT, turns 2+ | prefix-cache hit rate | tier hit rate | tier MB in / out | duration |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mb, r in rows:
        print(f"| {mb} | {r['ok']} | {r['p50_ttft_ms']:.0f} ms | {r['p50_later_ttft_ms']:.0f} ms | {r['prefix_hit_rate']:.1%} | "
              f"{r['tier_hit_rate']:.1%} ({r['tier_hits']} of {r['tier_queries']} tokens) | {r['tier_mb_in']:.0f} / {r['tier_mb_out']:.0f} | "
              f"{r['duration_s']:.1f} s |")


if __name__ == "__main__":
    main()
