"""Sending a `pdserve bench` workload: each request on its arrival schedule, at most
`--max-concurrency` in flight, and the pdserve cluster's KV figures around each run.

Lifecycle: `run_rates` opens the back-end once (`backends.make_backend`), sends `--warmup`
untimed requests, then for each rate calls `send_all` (every request on its arrival schedule:
`--request-rate` inf sends all at once, else Poisson or gamma gaps from `workloads`; a progress
bar counts completions; a chat_replay conversation sends its later turns one after the other)
and reads `kv_counters` before and after; it returns [(rate, outputs, seconds)]. benchmarks/
reuses `send_all` with its own back-ends.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from pdserve.bench.backends import Sampling, make_backend
from pdserve.bench.workloads import arrival_intervals, follow_up


async def send_all(backend, requests, rate: float, burstiness: float, max_concurrency: int | None, seed: int, progress: bool,
                   desc: str = "requests", tokenizer=None):
    """Send every request on its arrival schedule; returns (outputs in request order, seconds).
    A conversation (chat_replay: `next_turns`) sends its later turns one after the other, each
    once the previous answer is in; their outputs follow the first turn's."""
    from tqdm import tqdm

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
    """pdserve backend: the coordinator's KV hand-off bytes and count, its workers' prefix-cache
    tokens looked up and hit, and their host KV tier's tokens looked up and loaded and bytes put
    and loaded (the run's figures are the differences); None for other backends.

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
    tiers = [w.get("host_tier", {}) for w in s.get("workers", [])]  # the node's host KV tier (--kv-host-tier-mb), as each worker used it
    return {"kv_handoff_bytes": s["kv_transfer"]["bytes"], "kv_handoffs": s["kv_transfer"]["handoffs"],
            "prefix_cache_queries": sum(c.get("queries", 0) for c in caches), "prefix_cache_hits": sum(c.get("hits", 0) for c in caches),
            **{f"host_tier_{k}": sum(t.get(k, 0) for t in tiers) for k in ("queries", "hits", "bytes_in", "bytes_out")}}

