#!/usr/bin/env python
"""Serving benchmark: concurrent vs one-at-a-time through a launched cluster, and KV hand-off rates.

For each backend (shm, tcp) it launches coordinator + 1 prefill + 1 decode worker on this node
(default model unless --model), sends N requests one at a time and then all N at once (same
prompts, greedy, ignore_eos), and prints total wall time of each, their ratio, and the KV bytes
and seconds the prefill workers reported for their hand-offs (bytes/s per backend).
Usage: .venv/bin/python -m benchmarks.serving [--num 32] [--prompt-len 128] [--output-len 64]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

from pdserve.launch import Launcher, NodePlan
from pdserve.ports import free_port
from pdserve_client.library import AsyncClient, Client


def prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def concurrent(addr, ps, out_len):
    async with AsyncClient(addr, timeout=600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(c.generate(token_ids=p, temperature=0, max_tokens=out_len, ignore_eos=True) for p in ps))
        return time.perf_counter() - t0


def run_backend(args, backend):
    plan = NodePlan(model=args.model, kv_backend=backend, client_addr=f"tcp://127.0.0.1:{free_port()}",
                    worker_addr=f"tcp://127.0.0.1:{free_port()}", engine_args=["--kv-cache-mb", "512"], threads=args.threads, name="b",
                    coordinator_args=["--no-slo"])  # throughput: serve every request
    launcher = Launcher(plan, log_dir=tempfile.mkdtemp(prefix="pdserve-bench-"))
    launcher.start()
    try:
        launcher.wait_ready()
        ps = prompts(args.num, args.prompt_len)
        with Client(plan.client_addr, timeout=600) as c:
            c.generate(token_ids=ps[0], temperature=0, max_tokens=4, ignore_eos=True)  # warm-up
            t0 = time.perf_counter()
            for p in ps:
                c.generate(token_ids=p, temperature=0, max_tokens=args.output_len, ignore_eos=True)
            seq = time.perf_counter() - t0
            conc = asyncio.run(concurrent(plan.client_addr, ps, args.output_len))
            kv = c.stats()["kv_transfer"]
        return seq, conc, kv
    finally:
        launcher.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--backends", default="shm,tcp")
    args = ap.parse_args()
    print(f"{args.num} requests x ({args.prompt_len} prompt + {args.output_len} output tokens), 1 prefill + 1 decode, "
          f"{args.threads} thread(s) each")
    print(f"{'backend':8s} {'one-at-a-time s':>16s} {'concurrent s':>13s} {'speed-up':>9s} {'KV MB':>8s} {'KV s':>8s} {'KV GB/s':>8s}")
    for backend in args.backends.split(","):
        seq, conc, kv = run_backend(args, backend)
        rate = kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else float("nan")
        print(f"{backend:8s} {seq:16.2f} {conc:13.2f} {seq / conc:8.2f}x {kv['bytes'] / 1e6:8.1f} {kv['seconds']:8.3f} {rate:8.2f}")


if __name__ == "__main__":
    main()
