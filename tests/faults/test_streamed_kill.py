"""A prefill worker killed (SIGKILL) in the middle of a streamed hand-off (worker/handoff.py):
a long prompt, prefilled in many small chunks, has sent some of its blocks into the decode
worker's granted blocks over shm when its prefill worker dies. The decode side frees the grant
(its writer is gone), the coordinator places the request again on the other prefill worker, it
completes with the single-process greedy tokens, and every pool ends whole, nothing fenced.

Real processes on loopback: a coordinator, two prefill workers and one decode worker (tiny model).
"""
import asyncio
import os
import signal
import time

import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

PROMPT = [100 + (7 * j) % 3000 for j in range(4000)]  # 250 chunks of 16 tokens: seconds of streaming
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-long")
    save_tiny_served_model(d, hidden_size=128, intermediate_size=256, num_hidden_layers=4, max_position_embeddings=4096)
    return d


@pytest.mark.timeout(300)
def test_a_prefill_worker_killed_mid_stream_leaves_both_pools_whole(model_dir, tmp_path):
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=512), progress=False, tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = eng.generate([PROMPT], params)[0].token_ids
    launcher = start_cluster(model_dir, tmp_path, prefill=2, decode=1, kv_backend="shm",
                             engine_args=["--kv-cache-mb", "32", "--max-num-batched-tokens", "16", "--heartbeat-s", "0.1"],
                             coordinator_args=["--no-slo"])
    try:
        with Client(launcher.plan.client_addr) as stats_client:
            def prefill_workers():
                return {w["id"]: w for w in stats_client.stats()["workers"] if w["role"] == "prefill"}

            async def run():
                async with AsyncClient(launcher.plan.client_addr, timeout=120) as c:
                    task = asyncio.create_task(c.generate(token_ids=PROMPT, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
                    deadline = time.monotonic() + 60
                    while not (streaming := [w for w in prefill_workers().values() if w["kv_bytes_sent"] > 0]):
                        assert time.monotonic() < deadline and not task.done(), "no part was streamed"
                        await asyncio.sleep(0.02)
                    victim = streaming[0]
                    os.kill(victim["pid"], signal.SIGKILL)  # some blocks are in the decode pool, the rest never come
                    return victim, await task

            victim, result = asyncio.run(run())
            total = -(-(len(PROMPT) + 1) // 16)  # the grant's blocks
            assert 0 < victim["kv_bytes_sent"]
            # the victim never finished its hand-off: the request was prefilled again by the survivor
            assert result.prefill_worker != victim["id"] and result.token_ids == expected
            stats = wait_all_blocks_free(stats_client, timeout=30)
            assert all(w["fenced_blocks"] == 0 for w in stats["workers"])
            decode = next(w for w in stats["workers"] if w["role"] == "decode")
            assert decode["free_blocks"] == decode["total_blocks"] >= total
            assert stats["requests"]["retries"] >= 1
    finally:
        launcher.stop()
