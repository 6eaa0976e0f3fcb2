"""The prefix cache with real processes on loopback: colocated, and disaggregated over shm and
tcp (one prefill and one decode worker, so every hit is certain). A shared system prompt, a
second turn that resends the first turn and its answer, and n=3 copies of one prompt give the
single-process runtime's greedy tokens (cache off) token for token; the prefill worker skips the
cached prefix, the decode worker grants only the blocks it lacks and the hand-offs carry only
those; `pdserve stats` and /metrics show the hits; every pool is whole (every ref count zero) at the end."""
import asyncio
import json

import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.library import AsyncClient, Client
from pdserve_client.params import SamplingParams
from tests.gateway.helpers import scrape, value
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

BLOCK = 8
# --heartbeat-s 0.1 (as tests/serving/test_robustness.py): every check here ends in wait_all_blocks_free,
# which waits for two heartbeats after it starts; the cache's behaviour does not depend on their period
ENGINE = ["--num-blocks", "128", "--block-size", str(BLOCK), "--heartbeat-s", "0.1"]
SYSTEM = [100 + (j * 37) % 3000 for j in range(45)]  # 5 full blocks and a part
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def first_wave():
    return [SYSTEM + [4000 + j for j in range(7)]]


def second_wave(turn1_output):
    suffixes = [[5000 + 3 * i + j for j in range(n)] for i, n in enumerate([1, 9, 20])]
    turn2 = first_wave()[0] + turn1_output + [6000 + j for j in range(5)]
    copies = [SYSTEM + [7000, 7001, 7002]] * 3  # n=3 choices of one prompt
    return [SYSTEM + s for s in suffixes] + [turn2] + copies


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=256, block_size=BLOCK, prefix_cache=False), progress=False, tokenizer=False)
    first = [c.token_ids for c in eng.generate(first_wave(), SamplingParams(**GREEDY))]
    second = second_wave(first[0])
    return first, second, [c.token_ids for c in eng.generate(second, SamplingParams(**GREEDY))]


async def run_all(address, prompts):
    async with AsyncClient(address, timeout=120) as c:
        return await asyncio.gather(*(c.generate(token_ids=p, **GREEDY) for p in prompts))


def block_bytes(model_dir) -> int:
    cfg = json.load(open(f"{model_dir}/config.json"))
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4  # float32


def cache_cluster(model_dir, log_dir, mode):
    kwargs = dict(colocated=1, prefill=0, decode=0, gateway=True, http_port=free_port()) if mode == "colocated" else dict(prefill=1, decode=1, kv_backend=mode)
    return start_cluster(model_dir, log_dir, engine_args=ENGINE, **kwargs)


@pytest.fixture(scope="module")
def shm_cluster(model_dir, tmp_path_factory):
    """The shm pair, shared by the shm case below and the n-choices test (which counts from its own start)."""
    launcher = cache_cluster(model_dir, tmp_path_factory.mktemp("shm"), "shm")
    yield launcher
    launcher.stop()


@pytest.mark.parametrize("mode", ["shm", "tcp", "colocated"])
def test_prefix_cache_equal_tokens_fewer_bytes(model_dir, reference, tmp_path, request, mode):
    first, prompts, want = reference
    launcher = request.getfixturevalue("shm_cluster") if mode == "shm" else cache_cluster(model_dir, tmp_path, mode)
    try:
        addr = launcher.plan.client_addr
        assert [r.token_ids for r in asyncio.run(run_all(addr, first_wave()))] == first
        with Client(addr) as c:
            before = wait_all_blocks_free(c)["kv_transfer"]["bytes"]
        results = asyncio.run(run_all(addr, prompts))
        for i, (r, w) in enumerate(zip(results, want)):
            assert r.token_ids == w, f"request {i} ({mode})"
        with Client(addr) as c:
            stats = wait_all_blocks_free(c)  # every block free: every ref count zero
        caches = {w["role"]: w["prefix_cache"] for w in stats["workers"]}
        system_tokens = len(SYSTEM) // BLOCK * BLOCK
        if mode == "colocated":
            assert caches["colocated"]["hits"] >= len(prompts) * system_tokens, json.dumps(stats)
            samples, types = scrape(launcher.plan.http_url)  # the same counters on /metrics, under vLLM's names
            assert types["pdserve_prefix_cache_queries"] == "counter" and types["pdserve_prefix_cache_hits"] == "counter"
            assert value(samples, "pdserve_prefix_cache_hits_total", role="colocated") == caches["colocated"]["hits"]
            assert value(samples, "pdserve_prefix_cache_queries_total") == caches["colocated"]["queries"] > caches["colocated"]["hits"]
            assert value(samples, "pdserve_prefix_cache_blocks") == caches["colocated"]["cached_blocks"] > 0
            return
        assert caches["prefill"]["hits"] >= len(prompts) * system_tokens, json.dumps(stats)
        assert caches["decode"]["hits"] >= len(prompts) * system_tokens, json.dumps(stats)
        assert caches["decode"]["cached_blocks"] > 0 and 0 < caches["decode"]["hit_rate"] <= 1
        sent = stats["kv_transfer"]["bytes"] - before
        full = sum(-(-len(p) // BLOCK) for p in prompts) * block_bytes(model_dir)  # what every block of every prompt weighs
        assert 0 < sent <= full - len(prompts) * (system_tokens // BLOCK) * block_bytes(model_dir), (sent, full)
    finally:
        if mode != "shm":
            launcher.stop()


def test_no_prefix_cache_sends_every_block(model_dir, reference, tmp_path):
    first, prompts, want = reference
    launcher = start_cluster(model_dir, tmp_path, engine_args=[*ENGINE, "--no-prefix-cache"])
    try:
        addr = launcher.plan.client_addr
        assert [r.token_ids for r in asyncio.run(run_all(addr, first_wave() + prompts))] == first + want
        with Client(addr) as c:
            stats = wait_all_blocks_free(c)
        assert all(w["prefix_cache"]["hits"] == 0 and w["prefix_cache"]["cached_blocks"] == 0 for w in stats["workers"])
        assert all(w["engine"]["prefix_cache"] == 0 for w in stats["workers"])
        full = sum(-(-len(p) // BLOCK) for p in first_wave() + prompts) * block_bytes(model_dir)
        assert stats["kv_transfer"]["bytes"] == full
    finally:
        launcher.stop()


def test_n_choices_share_the_prompt_on_the_decode_worker(model_dir, shm_cluster):
    """3 choices of one fresh prompt at once: the first is prefilled and handed off whole, the
    other two wait for it and then move only the last partial block (the decode worker shares
    the full ones); all three get the single-process runtime's greedy tokens. On the shm pair the
    module shares: the prompt's blocks are new to it, and hits and bytes are counted from here."""
    prompt = [3000 + (j * 29) % 2000 for j in range(45)]  # 5 full blocks and a part
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=64, block_size=BLOCK, prefix_cache=False), progress=False, tokenizer=False)
    want = eng.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    decode_hits = lambda stats: next(w for w in stats["workers"] if w["role"] == "decode")["prefix_cache"]["hits"]  # noqa: E731
    with Client(shm_cluster.plan.client_addr) as c:
        before = wait_all_blocks_free(c)
    results = asyncio.run(run_all(shm_cluster.plan.client_addr, [prompt] * 3))
    assert [r.token_ids for r in results] == [want] * 3
    with Client(shm_cluster.plan.client_addr) as c:
        stats = wait_all_blocks_free(c)
    assert decode_hits(stats) - decode_hits(before) == 2 * 5 * BLOCK, json.dumps(stats)
    # one whole prompt, then its last block twice
    assert stats["kv_transfer"]["bytes"] - before["kv_transfer"]["bytes"] == (6 + 1 + 1) * block_bytes(model_dir)


def test_cache_salt_shares_only_within_a_salt(model_dir, shm_cluster):
    """A fresh prompt on the shm pair, one request at a time: run again with its cache_salt, the
    prefill worker skips its cached blocks and the decode worker grants them (the hand-off's
    blocks registered under the same salt on both sides); with another salt, or none, neither hits;
    unsalted requests share with each other as before. Every answer is the cache-off one."""
    prompt = [2000 + (j * 31) % 1500 for j in range(45)]  # 5 full blocks and a part
    eng = LLMEngine.load(str(model_dir), EngineConfig(num_blocks=64, block_size=BLOCK, prefix_cache=False), progress=False, tokenizer=False)
    want = eng.generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    addr = shm_cluster.plan.client_addr

    def hits(stats):
        return {w["role"]: w["prefix_cache"]["hits"] for w in stats["workers"]}

    def run(salt):
        with Client(addr) as c:
            before = hits(wait_all_blocks_free(c))
            assert c.generate(token_ids=prompt, cache_salt=salt, **GREEDY).token_ids == want
            after = hits(wait_all_blocks_free(c))
        return {role: after[role] - before[role] for role in after}

    run("tenant-a")
    assert run("tenant-a") == {"prefill": 5 * BLOCK, "decode": 5 * BLOCK}
    assert run("tenant-b") == {"prefill": 0, "decode": 0}
    assert run(None) == {"prefill": 0, "decode": 0}
    assert run(None) == {"prefill": 5 * BLOCK, "decode": 5 * BLOCK}
