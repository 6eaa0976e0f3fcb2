"""The host-memory KV tier with real processes: a `pdserve launch` colocated worker computes a
prompt, evicts its prefix from a small pool into the node's tier (--kv-host-tier-mb); a second
worker of the same node and coordinator starts, attaches to the same tier file, and once the
first is drained serves the prompt with its prefix loaded from the tier: hits in the
coordinator's stats and on the gateway's /metrics, greedy tokens equal to the single-process
engine's without any cache, every pool whole; the last worker out unlinks the tier's file. And one
prefill and one decode worker sharing the tier: the prefill worker loads an evicted prefix from it."""
import os
import subprocess
import sys
import time

import pytest

from pdserve.kvtransfer.pool_files import pool_dir
from pdserve.launcher_link import LauncherLink
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import Client
from pdserve_client.params import SamplingParams
from tests.gateway.helpers import poll, scrape, value
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

BLOCK = 8
ENGINE = ["--num-blocks", "16", "--block-size", str(BLOCK), "--heartbeat-s", "0.1", "--kv-host-tier-mb", "4"]
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = [100 + (j * 37) % 3000 for j in range(45)]  # 5 full blocks and a part
FILLERS = [[4000 + 300 * i + (j * 7) % 250 for j in range(45)] for i in range(3)]  # 7 blocks each with their output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def worker_stats(c: Client, wid: str) -> dict:
    return next(w for w in c.stats()["workers"] if w["id"] == wid)


def test_a_prefix_evicted_on_one_worker_is_served_from_the_tier_on_another(model_dir, tmp_path, own_shm_dir):
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=64, block_size=BLOCK, prefix_cache=False), progress=False, tokenizer=False)
    want = eng.generate([PROMPT], SamplingParams(**GREEDY))[0].token_ids
    launcher = start_cluster(model_dir, tmp_path / "logs", prefill=0, decode=0, colocated=1, engine_args=ENGINE,
                             gateway=True, http_port=free_port())
    second = None
    try:
        with Client(launcher.plan.client_addr, timeout=120) as c:
            (first,) = [w["id"] for w in c.stats()["workers"]]
            assert c.generate(token_ids=PROMPT, **GREEDY).token_ids == want
            for f in FILLERS:  # its pool of 16 blocks cannot keep PROMPT's cached blocks: they go to the tier
                c.generate(token_ids=f, **GREEDY)
            poll(lambda: worker_stats(c, first)["host_tier"]["bytes_in"] > 0, timeout=10)
            tiers = [f for f in os.listdir(pool_dir()) if f.startswith("tier-")]
            assert len(tiers) == 1
            log = open(tmp_path / "second.log", "wb")
            second = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--role", "colocated", "--coordinator",
                                       launcher.plan.worker_addr, "--model", str(model_dir), "--threads", "1", "--worker-id", "second",
                                       *ENGINE], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
            poll(lambda: any(w["id"] == "second" for w in c.stats()["workers"]), timeout=120)
            assert [f for f in os.listdir(pool_dir()) if f.startswith("tier-")] == tiers  # it attached to the node's tier
            link = LauncherLink(launcher.plan.client_addr, launcher.plan.worker_addr, None)
            try:
                poll(lambda: link.drain_worker(first) and worker_stats(c, first)["draining"] is not None, timeout=10)
            finally:
                link.close()
            assert c.generate(token_ids=PROMPT, **GREEDY).token_ids == want  # on the second worker, its prefix from the tier
            stats = wait_all_blocks_free(c, timeout=10)
            mine = next(w for w in stats["workers"] if w["id"] == "second")
            assert mine["host_tier"]["hits"] == 5 * BLOCK and mine["host_tier"]["bytes_out"] > 0
            assert mine["prefix_cache"]["hits"] == 5 * BLOCK  # counted as prefix-cache hits: its prefill started after them
            assert mine["host_tier"]["capacity"] > 0 and mine["host_tier"]["blocks"] > 0
            samples, types = scrape(launcher.plan.http_url)
            assert value(samples, "pdserve_kv_host_tier_hits_total", worker="second") == 5 * BLOCK
            assert value(samples, "pdserve_kv_host_tier_bytes_in_total", worker=first) > 0
            assert value(samples, "pdserve_kv_host_tier_hit_rate", worker="second") > 0
            assert types["pdserve_kv_host_tier_hits"] == "counter" and types["pdserve_kv_host_tier_blocks"] == "gauge"
        second.terminate()
        assert second.wait(timeout=30) == 0
        second = None
    finally:
        if second is not None:
            second.kill()
            second.wait()
        launcher.stop()
    deadline = time.monotonic() + 10
    while [f for f in os.listdir(pool_dir()) if f.startswith("tier-")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [f for f in os.listdir(pool_dir()) if f.startswith("tier-")]  # the last worker out unlinked it


def test_disaggregated_prefill_loads_from_the_tier(model_dir, tmp_path, own_shm_dir):
    """One prefill and one decode worker sharing the node's tier: the prefill worker's evicted
    prefix comes back from the tier (its prefill starts after it), the hand-off and the decode
    worker's tokens as without any cache, every pool whole."""
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=64, block_size=BLOCK, prefix_cache=False), progress=False, tokenizer=False)
    want = [c.token_ids for c in eng.generate([PROMPT, *FILLERS, PROMPT], SamplingParams(**GREEDY))]
    launcher = start_cluster(model_dir, tmp_path / "logs", prefill=1, decode=1, engine_args=ENGINE)
    try:
        with Client(launcher.plan.client_addr, timeout=120) as c:
            got = [c.generate(token_ids=p, **GREEDY).token_ids for p in [PROMPT, *FILLERS, PROMPT]]
            assert got == want
            stats = wait_all_blocks_free(c, timeout=10)
            prefill = next(w for w in stats["workers"] if w["role"] == "prefill")
            assert prefill["host_tier"]["hits"] == 5 * BLOCK  # loaded, whichever worker put it (a key already there is not put again)
            assert sum(w["host_tier"]["bytes_in"] for w in stats["workers"]) > 0
            assert len({w["host_tier"]["capacity"] for w in stats["workers"]}) == 1  # one tier on the node
    finally:
        launcher.stop()
