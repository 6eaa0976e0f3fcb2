"""Faults with real processes: a decode worker killed with streams in flight, a prefill worker
killed while it holds hand-offs, and a coordinator restart. Nothing hangs: every request either
completes with the single-process greedy output or ends with a typed error, within bounds, and
the surviving workers end with every KV block free."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve_client.library import AsyncClient, Client, RequestError, RequestLost
from tests.helpers import start_cluster, wait_all_blocks_free
from tests.helpers import stream_prompts as prompts

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def model_dir(kill_model_dir):
    return kill_model_dir


@pytest.fixture(scope="module")
def expected(kill_expected):
    """The single-process greedy tokens of prompts(8) (tests/faults/conftest.py, shared with test_supervised_launch.py)."""
    return [e[:MAX_TOKENS] for e in kill_expected]


def proc(launcher, name):
    return dict(launcher.procs)[name]


async def run_and_kill(address, kill, when_tokens: int, max_tokens: int = MAX_TOKENS, timeout: float = 60):
    """Start 8 greedy streams; once `when_tokens` tokens have arrived in total, call kill().
    Returns per request: token ids, or the typed error, and the seconds from the kill to its end."""
    killed_at = []
    total = [0]

    async def one(c, p):
        toks = []
        try:
            async for d in c.stream(token_ids=p, temperature=0, max_tokens=max_tokens, ignore_eos=True):
                toks += d.token_ids
                total[0] += len(d.token_ids)
                if total[0] >= when_tokens and not killed_at:
                    killed_at.append(time.monotonic())
                    kill()
            return toks, time.monotonic()
        except RequestError as e:
            return e, time.monotonic()

    async with AsyncClient(address, timeout=timeout) as c:
        outs = await asyncio.gather(*(one(c, p) for p in prompts(8)))
    assert killed_at, "the kill never happened"
    return [(r, end - killed_at[0]) for r, end in outs]


def check_outcomes(outs, expected, bound_s):
    completed = 0
    for i, (r, after) in enumerate(outs):
        if isinstance(r, RequestError):
            assert r.code in ("worker_lost", "kv_transfer_failed", "kv_transfer_timeout"), r
            assert after < bound_s, f"request {i} failed {after:.1f}s after the kill"
        else:
            assert r == expected[i], f"request {i} completed with different tokens"
            completed += 1
    return completed


def test_decode_worker_killed_mid_stream(model_dir, expected, tmp_path):
    launcher = start_cluster(model_dir, tmp_path, prefill=1, decode=2, engine_args=["--kv-cache-mb", "16"])
    try:
        victim = proc(launcher, "decode-0")
        outs = asyncio.run(run_and_kill(launcher.plan.client_addr, lambda: os.kill(victim.pid, signal.SIGKILL), 200))
        completed = check_outcomes(outs, expected, bound_s=5.0)
        assert completed == 8  # a survivor exists, so every stream resumes there
        with Client(launcher.plan.client_addr) as c:
            stats = c.stats()
            assert stats["requests"]["workers_lost"] == 1 and stats["requests"]["retries"] >= 1
            r = c.generate(token_ids=[7, 8, 9], temperature=0, max_tokens=5, ignore_eos=True)
            assert r.completion_tokens == 5
            stats = wait_all_blocks_free(c)
            assert {w["id"] for w in stats["workers"]} == {"t-prefill-0", "t-decode-1"}
    finally:
        launcher.stop()


def test_prefill_worker_killed_holding_handoffs(model_dir, expected, tmp_path):
    # A 1.5 s batching window keeps prompts queued on the prefill worker long enough to kill it.
    launcher = start_cluster(model_dir, tmp_path, prefill=2, decode=1, engine_args=["--kv-cache-mb", "16"],
                             prefill_args=["--batch-window-ms", "1500"],
                             coordinator_args=["--no-slo"])  # placement by queued tokens: both prefill workers hold prompts
    try:
        victim = proc(launcher, "prefill-0")

        async def go():
            async with AsyncClient(launcher.plan.client_addr, timeout=60) as c:
                tasks = [asyncio.create_task(c.generate(token_ids=p, temperature=0, max_tokens=20, ignore_eos=True)) for p in prompts(8)]
                await asyncio.sleep(0.5)  # the 1.5 s window: both prefill workers now hold prompts
                os.kill(victim.pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)

        results = asyncio.run(go())
        assert [r.token_ids for r in results] == [e[:20] for e in expected]
        assert {r.prefill_worker for r in results} == {"t-prefill-1"}
        with Client(launcher.plan.client_addr) as c:
            stats = wait_all_blocks_free(c)
            assert stats["requests"]["retries"] >= 1
    finally:
        launcher.stop()


def test_coordinator_restart(model_dir, tmp_path):
    launcher = start_cluster(model_dir, tmp_path, prefill=1, decode=1, engine_args=["--kv-cache-mb", "16"])
    coord = proc(launcher, "coordinator")
    args = [sys.executable, "-m", "pdserve", "coordinator", "--clients", launcher.plan.client_addr,
            "--workers", launcher.plan.worker_addr, "--model", str(model_dir)]
    new = None
    try:
        with Client(launcher.plan.client_addr, timeout=30) as c:
            stream = c.stream(token_ids=prompts(1)[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            next(stream)
            os.kill(coord.pid, signal.SIGKILL)
            coord.wait()
            new = subprocess.Popen(args, stdout=open(tmp_path / "coord2.log", "w"), stderr=subprocess.STDOUT)
            t0 = time.monotonic()
            with pytest.raises(RequestLost):
                for _ in stream:
                    pass
            assert time.monotonic() - t0 < 15
            deadline = time.monotonic() + 30
            while len(c.stats()["workers"]) < 2:  # workers re-register by themselves
                assert time.monotonic() < deadline, "workers did not re-register"
                time.sleep(0.1)
            assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=4, ignore_eos=True).completion_tokens == 4
            wait_all_blocks_free(c, timeout=10)
    finally:
        if new is not None:
            new.terminate()
            new.wait(10)
        launcher.stop()
