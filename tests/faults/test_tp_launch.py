"""Tensor parallelism through `pdserve launch` on the default model (SmolLM2-135M: 9 heads, 3 KV
heads, TP 3 splits it): colocated workers with TP 3 give the TP 1 engine's greedy tokens; a rank
of one killed with -9 mid-stream takes that worker down (its other rank leaves too), the
coordinator re-places its requests on the other, the launcher restarts it, and every stream
completes identically or ends with a typed error; the
hand-off between prefill and decode workers of different TP sizes, over shm and tcp, gives
the TP 1 tokens. Every test ends with every pool whole. TP 1 against HF transformers is
established elsewhere (tests/runtime/test_hf_equivalence.py). A model that does not split, and
pipeline parallelism, are refused at start."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.common.errors import EX_CONFIG
from pdserve.common.model_path import resolve_model_path
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.faults.test_supervised_launch import Node, poll
from tests.faults.test_worker_death import check_outcomes, prompts, run_and_kill
from tests.helpers import free_port, pools_of, wait_all_blocks_free

pytestmark = pytest.mark.slow  # loads the default model

MAX_TOKENS = 32
POOL = "--engine-arg=--kv-cache-mb=24"


@pytest.fixture(scope="module")
def model():
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def expected(model):
    """The TP 1 engine's greedy tokens for prompts(8), served as the workers serve them."""
    eng = LLMEngine.load(str(model), EngineConfig(num_blocks=256), progress=False, tokenizer=False)
    return [c.token_ids for c in eng.generate(prompts(8), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]


async def _all(address: str, n: int) -> list[list[int]]:
    async with AsyncClient(address, timeout=120) as c:
        results = await asyncio.gather(*(c.generate(token_ids=p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts(n)))
    return [r.token_ids for r in results]


def ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes worker pid started."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "pdserve.worker.tp_ranks" in line]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper has left all the same
        return f.read().split(") ")[1].startswith("Z")


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
def test_colocated_tp3_equals_tp1_and_survives_a_killed_rank(model, expected, tmp_path):
    """Two colocated TP 3 workers (a cluster file: `--colocated` starts one); a rank of the busier
    one killed mid-stream: its requests are re-placed on the other."""
    clients, workers = free_port(), free_port()
    toml = tmp_path / "cluster.toml"
    toml.write_text(f'[cluster]\nmodel = "{model}"\nclient_port = {clients}\nworker_port = {workers}\nkv_cache_mb = 24\n'
                    f'[nodes.local]\ncoordinator = true\ncolocated = 2\n')
    node = Node(model, tmp_path, "--config", str(toml), "--node", "local", "--tensor-parallel-size", "3")
    node.clients = f"tcp://127.0.0.1:{clients}"
    try:
        stats = node.wait_workers(2)
        assert [w["engine"]["tensor_parallel_size"] for w in stats["workers"]] == [3, 3]
        assert asyncio.run(_all(node.clients, 4)) == expected[:4]
        victim = {}

        def kill_a_rank():
            with Client(node.clients, timeout=5) as c:
                victim.update(max(c.stats()["workers"], key=lambda w: w["inflight"]))
            victim["ranks"] = ranks_of(victim["pid"])
            os.kill(victim["ranks"][0], signal.SIGKILL)

        outs = asyncio.run(run_and_kill(node.clients, kill_a_rank, 40, max_tokens=MAX_TOKENS, timeout=120))
        killed_at = time.monotonic()
        completed = check_outcomes(outs, expected, bound_s=20)
        assert victim["inflight"] >= 1 and len(victim["ranks"]) == 2 and completed >= 8 - victim["inflight"]
        poll("the other rank's exit", lambda: gone(victim["ranks"][1]), 10)
        with Client(node.clients, timeout=30) as c:
            back = poll("the worker's return", lambda: [w for w in c.stats()["workers"] if w["id"] == victim["id"] and w["pid"] != victim["pid"]], 120)
            assert len(ranks_of(back[0]["pid"])) == 2
            assert asyncio.run(_all(node.clients, 2)) == expected[:2]
            wait_all_blocks_free(c, timeout=10)
        assert time.monotonic() - killed_at < 150
        assert not pools_of(victim["pid"])  # the stopped worker's pool is gone
        assert f"(pid {victim['pid']}) exited" in node.stderr()
    finally:
        assert node.stop() == 0


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
# TP 3 to TP 3 (shm, 21 s) left out for the suite's time: each direction of a TP change is here, equal sizes in the colocated TP-3 test
@pytest.mark.parametrize("prefill_tp,decode_tp,backend", [(3, 1, "tcp"), (1, 3, "shm")])
def test_handoff_across_tp_sizes(model, expected, tmp_path, prefill_tp, decode_tp, backend):
    node = Node(model, tmp_path, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--kv-backend", backend,
                "--fixed-roles", "--paths", "remote", POOL)  # every prompt handed off (auto would prefill them on the decode worker)
    try:
        stats = node.wait_workers(2)
        assert {w["role"]: w["engine"]["tensor_parallel_size"] for w in stats["workers"]} == {"prefill": prefill_tp, "decode": decode_tp}
        assert asyncio.run(_all(node.clients, 4)) == expected[:4]
        with Client(node.clients, timeout=30) as c:
            stats = wait_all_blocks_free(c, timeout=10)
            assert [w["kv_bytes_sent"] > 0 for w in stats["workers"] if w["role"] == "prefill"] == [True]
    finally:
        assert node.stop() == 0


def test_unsplittable_or_unsupported_parallelism_refused_at_start():
    """The default model's 9 heads do not split 2 ways: the worker exits with EX_CONFIG and says
    why before it starts any rank; pipeline parallelism is a usage error of `pdserve launch`."""
    run = dict(capture_output=True, text=True, timeout=120)
    worker = subprocess.run([sys.executable, "-m", "pdserve", "worker", "-tp", "2", "--coordinator", "tcp://127.0.0.1:1",
                             "--num-blocks", "16"], **run)
    assert worker.returncode == EX_CONFIG and "tensor parallel size 2 does not divide the model's 9 attention heads" in worker.stderr
    launch = subprocess.run([sys.executable, "-m", "pdserve", "launch", "--pipeline-parallel-size", "2", "--no-gateway"], **run)
    assert launch.returncode == 2 and "pipeline parallelism is not supported" in launch.stderr
