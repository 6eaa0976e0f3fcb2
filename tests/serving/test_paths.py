"""Each request's path with real processes on loopback (coordinator + 1 prefill + 1 decode).

Without SLO control the coordinator follows Dynamo's rule: prompts with few uncached tokens are
prefilled on the decode worker itself (LOCAL), long ones on the prefill worker and handed off
(REMOTE). Both ways give exactly the single-process runtime's greedy tokens (what the colocated
launch is held to in test_disaggregated.py), the stats count each path and its reason, and every
pool is whole after.

Roles follow the load (needs workers that can switch role: skipped unless a registered worker's
Hello.roles names more than one): a prompt-heavy phase turns a decode worker into a prefill
worker, a decode-heavy phase turns one back; no request is lost, outputs stay greedy-exact and
every pool is whole. Each phase's requests carry targets that phase cannot meet (and the other
phase's loose ones), so that it is short of capacity on a fast machine as on a loaded one.
"""
import asyncio
import os
import time

import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

LOCAL_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def prompts(lengths, first=10):
    """Distinct prompts (no shared prefix) of these lengths."""
    return [[first + 997 * i + j for j in range(n)] for i, n in enumerate(lengths)]


def reference(model_dir, jobs, max_tokens):
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=512), progress=False, tokenizer=False)
    return [c.token_ids for c in eng.generate(jobs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]


def test_short_prompts_go_local_and_long_ones_remote_with_the_same_tokens(model_dir, tmp_path):
    short, long_ = prompts([5, 17, 30]), prompts([90, 150, 200], first=20000)
    launcher = start_cluster(model_dir, tmp_path, engine_args=["--kv-cache-mb", "16"],
                             coordinator_args=["--no-slo", "--paths", "auto", "--local-prefill-tokens", str(LOCAL_TOKENS)])
    try:
        with Client(launcher.plan.client_addr, timeout=60) as c:
            # one at a time: with an empty prefill queue Dynamo's rule decides by the prompt alone
            results = [c.generate(token_ids=p, max_tokens=12, temperature=0, ignore_eos=True) for p in short + long_]
            stats = wait_all_blocks_free(c)
        assert [r.token_ids for r in results] == reference(model_dir, short + long_, 12)
        assert [r.prefill_worker is None for r in results] == [True] * len(short) + [False] * len(long_)
        assert {r.decode_worker for r in results} == {"t-decode-0"}
        counts = stats["requests"]
        assert (counts.get("path:local"), counts.get("path:remote")) == (len(short), len(long_))
        assert (counts.get("path_reason:short_prompt"), counts.get("path_reason:long_prompt")) == (len(short), len(long_))
        assert stats["kv_transfer"]["handoffs"] == len(long_)
        assert all(w["inflight"] == 0 for w in stats["workers"])
    finally:
        launcher.stop()


def wait_for(client, check, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if check(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {stats['planner']}")
        time.sleep(0.1)


PHASE_S = 90.0  # a phase that has not moved a role by then fails


async def phase(address, jobs, max_tokens, until, what, stats, ttft_ms, tpot_ms):
    """Send `jobs` in waves of concurrent requests, each with its own targets ttft_ms and tpot_ms,
    until until() is true (at most PHASE_S); every result or error."""
    out = []
    deadline = time.monotonic() + PHASE_S
    async with AsyncClient(address, timeout=120) as c:
        while not until():
            if time.monotonic() > deadline:
                s = stats()
                raise AssertionError(f"{what} within {PHASE_S:g} s: {s['planner']}; requests {s['requests']}; slo {s['slo']}")
            for r in await asyncio.gather(*(c.generate(token_ids=p, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                       ttft_ms=ttft_ms, tpot_ms=tpot_ms) for p in jobs), return_exceptions=True):
                out.append(r)
    return out


def test_roles_follow_a_prompt_heavy_then_a_decode_heavy_load(model_dir, tmp_path):
    # Each phase's requests carry their own targets (within --client-target-range) so that one
    # phase is short whatever the machine's speed: the prompt phase asks for a TTFT no 600-token
    # prompt has (5 ms) and a loose TPOT (100 ms), the decode phase for a loose TTFT (500 ms) and a
    # TPOT no decode step has (1 ms).
    launcher = start_cluster(model_dir, tmp_path, prefill=1, decode=2, engine_args=["--kv-cache-mb", "32"], coordinator_args=[
        "--paths", "auto", "--planner", "--planner-window-s", "0.5", "--planner-dwell-s", "2", "--ttft-p99-ms", "5", "--tpot-p99-ms", "1",
        "--client-target-range", "1:100"])
    try:
        with Client(launcher.plan.client_addr, timeout=60) as c:
            if not any(len(w.get("roles", [])) > 1 for w in c.stats()["workers"]):
                pytest.skip("no registered worker can change role without a restart (Hello.roles)")
            counts = lambda s: s["planner"].get("counts", {})  # noqa: E731
            heavy_prompts = prompts([600] * 6)
            done = lambda: counts(c.stats()).get("confirmed", 0) >= 1  # noqa: E731
            first = asyncio.run(phase(launcher.plan.client_addr, heavy_prompts, 1, done, "no role change", c.stats, 5, 100))
            stats = wait_for(c, lambda s: counts(s).get("decode_to_prefill", 0) >= 1, 5, "no decode worker became a prefill worker")
            assert sorted(w["role"] for w in stats["workers"]) == ["decode", "prefill", "prefill"]
            streams = prompts([8] * 24, first=20000)
            back = lambda: counts(c.stats()).get("prefill_to_decode", 0) >= 1 and counts(c.stats()).get("confirmed", 0) >= 2  # noqa: E731
            second = asyncio.run(phase(launcher.plan.client_addr, streams, 64, back, "no role change back", c.stats, 500, 1))
            stats = wait_all_blocks_free(c, timeout=30)
        for jobs, results, n in ((heavy_prompts, first, 1), (streams, second, 64)):
            want = reference(model_dir, jobs, n)
            for i, r in enumerate(results):
                if isinstance(r, Exception):
                    assert getattr(r, "code", None) == "slo_unattainable", r  # shed at once: never lost
                else:
                    assert r.token_ids == want[i % len(jobs)]
        assert stats["active_requests"] == 0 and all(w["inflight"] == 0 for w in stats["workers"])
    finally:
        launcher.stop()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a core share of one core never runs a step on fewer threads")
def test_two_decode_workers_without_a_prefill_worker_serve_locally_and_report_their_shared_steps(model_dir, tmp_path):
    """`--prefill 0 --decode 2` on one core share (what the planner leaves after moving a 1 + 1
    node's prefill worker): /health is ready (a decode worker prefills locally), concurrent
    requests spread over both workers with the single-process runtime's greedy tokens, the steps
    each ran while the other was busy (on cores // 2 threads) reach the coordinator apart
    (Heartbeat.shared_steps -> stats `core_share`), and every pool is whole after."""
    import httpx

    from tests.gateway.helpers import poll
    from tests.helpers import free_port

    jobs = prompts([40 + 7 * i for i in range(12)])
    launcher = start_cluster(model_dir, tmp_path, prefill=0, decode=2, threads=None, engine_args=["--kv-cache-mb", "16"],
                             coordinator_args=["--ttft-p99-ms", "60000", "--tpot-p99-ms", "10000"], gateway=True, http_port=free_port())
    try:
        # the gateway reads the coordinator's stats about once a second: until then it may count one worker
        health = poll(lambda: (r := httpx.get(f"{launcher.plan.http_url}/health", timeout=10)).json()["workers"] == {"decode": 2} and r, timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ready", health.text

        async def send():
            async with AsyncClient(launcher.plan.client_addr, timeout=120) as c:
                return await asyncio.gather(*(c.generate(token_ids=p, max_tokens=24, temperature=0, ignore_eos=True) for p in jobs))

        results = asyncio.run(send())
        with Client(launcher.plan.client_addr, timeout=60) as c:
            stats = wait_all_blocks_free(c)
    finally:
        launcher.stop()
    assert [r.token_ids for r in results] == reference(model_dir, jobs, 24)
    assert {r.decode_worker for r in results} == {"t-decode-0", "t-decode-1"} and all(r.prefill_worker is None for r in results)
    assert stats["requests"].get("path:local") == len(jobs)
    workers = {w["id"]: w for w in stats["workers"]}
    assert {w["engine"]["cores"] for w in workers.values()} == {os.cpu_count()}
    assert sum(w["core_share"]["shared_steps"] for w in workers.values()) > 0, [w["core_share"] for w in workers.values()]
