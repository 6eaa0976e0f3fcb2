"""kill -9 of one rank of a tensor-parallel worker on GPUs (NCCL) through `pdserve launch` (`gpu`
test; scripts/gpu_check runs it): the worker's step waits in an NCCL collective for the dead rank
on the GPU, where no signal reaches it, so rank 0's watch ends the worker itself (not torch's
watchdog after the compute timeout, which would abort it); every stream completes as TP 1's or
ends with a typed error, none hangs, the other rank leaves, the launcher restarts the worker on the
same GPUs (`--device cuda`: placed by the launcher) and it serves TP 1's tokens with every block
free. The CPU twin (gloo) is tests/faults/test_tp_launch.py."""
import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.faults.test_supervised_launch import Node, poll
from tests.faults.test_tp_launch import gone, ranks_of
from tests.faults.test_worker_death import check_outcomes, prompts, run_and_kill
from tests.helpers import wait_all_blocks_free

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MAX_TOKENS = 32
EXIT_BOUND_S = 5.0  # the watch's 0.2 s and its 2 s grace (worker.tp_ranks.STOP_GRACE_S), well under NCCL's 10 s timeout


async def _all(address: str, n: int) -> list[list[int]]:
    async with AsyncClient(address, timeout=120) as c:
        results = await asyncio.gather(*(c.generate(token_ids=p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts(n)))
    return [r.token_ids for r in results]


def kill_and_time(victim: dict) -> None:
    """SIGKILL the worker's other rank; a thread records how long the worker outlives it (victim["after"])."""
    os.kill(victim["ranks"][0], signal.SIGKILL)
    t0 = time.monotonic()

    def watch():
        while not gone(victim["pid"]) and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        victim["after"] = time.monotonic() - t0

    threading.Thread(target=watch, daemon=True).start()


def test_a_killed_rank_ends_its_nccl_worker_at_once_and_it_comes_back(kill_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices (one per rank: NCCL refuses two ranks on one), this machine has {torch.cuda.device_count()}")
    pytest.importorskip("cupy")  # a TP worker's ranks share their KV pools with rank 0 over CUDA IPC
    ref = LLMEngine.load(str(kill_model_dir), EngineConfig(num_blocks=256, device="cuda", dtype="float32"), progress=False, tokenizer=False)
    expected = [c.token_ids for c in ref.generate(prompts(8), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    del ref
    node = Node(kill_model_dir, tmp_path, "--colocated", "--device", "cuda", "--dtype", "float32", "--tensor-parallel-size", "2",
                "--kv-cache-mb", "64")
    try:
        stats = node.wait_workers(1)
        worker = stats["workers"][0]
        assert worker["engine"]["tensor_parallel_size"] == 2 and worker["engine"]["device"] == "cuda:0"  # placed: cuda:0-1
        assert asyncio.run(_all(node.clients, 2)) == expected[:2]
        victim = {"pid": worker["pid"], "ranks": ranks_of(worker["pid"])}
        outs = asyncio.run(run_and_kill(node.clients, lambda: kill_and_time(victim), 40, max_tokens=MAX_TOKENS, timeout=120))
        killed_at = time.monotonic()
        check_outcomes(outs, expected, bound_s=30)
        assert len(victim["ranks"]) == 1
        assert poll("the worker's exit", lambda: victim.get("after"), 60) < EXIT_BOUND_S, victim
        assert "signal SIGABRT" not in node.stderr() and f"(pid {victim['pid']}) exited" in node.stderr()  # ended by its watch
        with Client(node.clients, timeout=30) as c:
            back = poll("the worker's return", lambda: [w for w in c.stats()["workers"] if w["pid"] != victim["pid"]], 150)
            assert len(ranks_of(back[0]["pid"])) == 1 and back[0]["engine"]["device"] == "cuda:0"
            assert asyncio.run(_all(node.clients, 2)) == expected[:2]
            wait_all_blocks_free(c, timeout=10)
        assert time.monotonic() - killed_at < 180
    finally:
        assert node.stop() == 0
