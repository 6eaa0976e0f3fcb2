"""A prefill worker stopped (SIGSTOP) while it holds a granted hand-off, then resumed: the
coordinator drops it and places its request again, the decode worker fences the given-up grant's
blocks instead of handing them to the next request, and the stale write that lands when the
worker wakes up touches only those fenced blocks. Every other request's greedy output is the
single-process one (tokens, and logprobs to 1e-3: a tiny random model's greedy choice can
survive a corrupted context, its logprobs cannot), the stalled request completes identically (or
ends with a typed error), and every pool ends whole."""
import asyncio
import os
import signal
import time

import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client, RequestError
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

# 21 blocks of 16 tokens on the decode worker: the stalled request's grant (10 blocks) given up
# and freed would be the first blocks the next request (10 blocks) gets.
A = [200] * 150  # the stalled request (10 blocks): one token, so its KV is nothing like any other prompt's
C = [5000 + 3 * j for j in range(150)]  # a later request that would receive A's old blocks
A_TOKENS, C_TOKENS = 16, 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    return d


def poll(what, check, timeout):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.05)
    return got


def test_a_stopped_prefill_worker_cannot_write_into_blocks_another_request_owns(model_dir, tmp_path):
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=256), progress=False, tokenizer=False)
    ref_a, ref_c = eng.generate([A, C], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
                                         for n in (A_TOKENS, C_TOKENS)])
    launcher = start_cluster(model_dir, tmp_path, prefill=2, decode=1, kv_backend="shm", engine_args=["--num-blocks", "21"],
                             prefill_args=["--batch-window-ms", "3000"],  # prompts wait 3 s on a prefill worker: time to stop it
                             coordinator_args=["--no-slo"])  # requests wait for decode room instead of being shed
    stopped = None
    try:
        with Client(launcher.plan.client_addr) as stats_client:
            def workers():
                return {w["id"]: w for w in stats_client.stats()["workers"]}

            async def run():
                nonlocal stopped
                async with AsyncClient(launcher.plan.client_addr, timeout=120) as c:
                    async def one(prompt, n, started=None):
                        toks, logprobs = [], []
                        try:
                            async for d in c.stream(token_ids=prompt, temperature=0, max_tokens=n, ignore_eos=True, logprobs=0):
                                toks += d.token_ids
                                logprobs += d.logprobs or []
                                if started is not None and len(toks) >= 3:
                                    started.set()
                            return toks, logprobs
                        except RequestError as e:
                            return e

                    a = asyncio.create_task(one(A, A_TOKENS))
                    holder = await asyncio.to_thread(poll, "A queued on a prefill worker", lambda: [
                        w for w in workers().values() if w["role"] == "prefill" and w["queue"] >= 1], 10)
                    stopped = holder[0]
                    os.kill(stopped["pid"], signal.SIGSTOP)  # it holds A's grant on the decode worker
                    await asyncio.to_thread(poll, "the stopped worker dropped", lambda: stopped["id"] not in workers(), 15)
                    fenced = await asyncio.to_thread(poll, "A's old grant fenced", lambda: [
                        w["fenced_blocks"] for w in workers().values() if w["role"] == "decode" and w["fenced_blocks"]], 10)
                    assert fenced == [10]
                    c_started = asyncio.Event()
                    c_task = asyncio.create_task(one(C, C_TOKENS, c_started))
                    await asyncio.wait_for(c_started.wait(), 60)
                    os.kill(stopped["pid"], signal.SIGCONT)  # it wakes up and writes A's KV where its grant was
                    return await a, await c_task

            got_a, got_c = asyncio.run(run())
            stopped_pid, stopped = stopped["pid"], None
            for (toks, logprobs), ref in [(got_c, ref_c)] + ([] if isinstance(got_a, RequestError) else [(got_a, ref_a)]):
                assert toks == ref.token_ids, "a stale write reached another request's blocks"
                assert max(abs(x - y) for x, y in zip(logprobs, ref.logprobs, strict=True)) < 1e-3, "a stale write reached another request's blocks"
            if isinstance(got_a, RequestError):
                assert got_a.code in ("worker_lost", "kv_transfer_failed", "kv_transfer_timeout"), got_a
            poll("the resumed worker's return", lambda: len(workers()) == 3, 20)
            stats = wait_all_blocks_free(stats_client, timeout=10)
            assert all(w["fenced_blocks"] == 0 for w in stats["workers"])
            assert stats["requests"]["retries"] >= 1
            assert stopped_pid in {w["pid"] for w in stats["workers"]}
    finally:
        if stopped is not None:
            os.kill(stopped["pid"], signal.SIGCONT)
        launcher.stop()
