"""The host-memory KV tier under the single-process engine on a tiny random model: a prompt whose
prefix a small pool evicted is loaded back from the tier (counted as prefix-cache hits, the
prefill starting after them) and gives the same greedy tokens as recomputing it, and as HF
transformers; a second engine attached to the same tier (another worker of the node, keyed with
the same secret) loads the first one's blocks instead of computing them; preempted sequences
come back through the tier with the same tokens; every pool is whole at the end."""

import pytest
import transformers

from pdserve.common.prefix_hash import chain_hashes
from pdserve.kvtransfer import host_tier
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams
from tests.helpers import assert_greedy_equal, hf_greedy, save_tiny_model

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = [5 + (j * 13) % 400 for j in range(45)]  # 5 full blocks and a part
FILLERS = [[300 + i * 50 + (j * 7) % 40 for j in range(45)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=256)
    return d


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy tokens of PROMPT from the engine with nothing cached, checked against HF transformers."""
    eng = LLMEngine.load(str(tiny), EngineConfig(num_blocks=64, block_size=BS, prefix_cache=False), progress=False, tokenizer=False)
    ours = eng.generate([PROMPT], GREEDY)[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    ref, logits = hf_greedy(hf, PROMPT, GREEDY.max_tokens, eos=False)
    assert assert_greedy_equal(ours, ref, logits, "engine, no cache") == GREEDY.max_tokens
    return ours, ref, logits


def engine(tiny, tier_mb=1.0, **kw):
    conf = EngineConfig(**{"num_blocks": 14, "block_size": BS, "kv_host_tier_bytes": int(tier_mb * 2**20), **kw})
    eng = LLMEngine.load(str(tiny), conf, progress=False, tokenizer=False)
    return eng, host_tier.attach(eng, conf, str(tiny))


def assert_whole(eng):
    assert eng.blocks.free_blocks == eng.blocks.num_blocks and eng.blocks.leaked() == []


def test_an_evicted_prefix_comes_back_from_the_tier_with_the_same_tokens(tiny, reference, own_shm_dir):
    ours, ref, logits = reference
    eng, tier = engine(tiny)
    link = eng.blocks.tier
    try:
        assert eng.generate([PROMPT], GREEDY)[0].token_ids == ours
        for f in FILLERS:  # 7 blocks each in a pool of 14: PROMPT's cached blocks are evicted, into the tier
            eng.generate([f], GREEDY)
        keys = chain_hashes(PROMPT, BS, eng.blocks.prefix_key, 5)
        assert tier.puts >= 5 and not set(keys) & set(eng.blocks.by_hash)  # none of its blocks left here
        assert link.hits == 0
        hits_before = eng.blocks.hits
        again = eng.generate([PROMPT], GREEDY)[0].token_ids
        assert again == ours
        assert_greedy_equal(again, ref, logits, "prefix loaded from the host tier")
        assert link.hits == 5 * BS  # its 5 full blocks loaded, not computed
        assert eng.blocks.hits - hits_before == 5 * BS  # and counted as prefix-cache hits
        report = link.report()
        assert report["host_tier_bytes_out"] == 5 * tier.slot_bytes and report["host_tier_bytes_in"] == tier.puts * tier.slot_bytes
        assert_whole(eng)
    finally:
        tier.close()


def test_another_engine_on_the_node_loads_the_first_ones_blocks(tiny, reference, own_shm_dir):
    ours, ref, logits = reference
    first, tier_a = engine(tiny)
    second, tier_b = engine(tiny)
    try:
        assert tier_a.path == tier_b.path  # one tier per model on the node
        second.blocks.set_prefix_key(first.blocks.prefix_key)  # one coordinator's secret (its Welcome)
        assert first.generate([PROMPT], GREEDY)[0].token_ids == ours
        for f in FILLERS:
            first.generate([f], GREEDY)
        out = second.generate([PROMPT], GREEDY)[0].token_ids
        assert out == ours
        assert_greedy_equal(out, ref, logits, "another engine, from the tier")
        assert second.blocks.tier.hits == 5 * BS and second.blocks.hits == 5 * BS
        third, tier_c = engine(tiny)  # keyed with a secret of its own (another deployment): never a hit
        try:
            assert third.generate([PROMPT], GREEDY)[0].token_ids == ours and third.blocks.tier.hits == 0
            assert_whole(third)
        finally:
            tier_c.close()
        assert_whole(first)
        assert_whole(second)
    finally:
        tier_a.close()
        tier_b.close()


def test_preempted_sequences_come_back_through_the_tier(tiny, reference, own_shm_dir):
    prompts = [PROMPT] + FILLERS
    off = LLMEngine.load(str(tiny), EngineConfig(num_blocks=64, block_size=BS, prefix_cache=False), progress=False, tokenizer=False)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [c.token_ids for c in off.generate(prompts, long)]
    eng, tier = engine(tiny, num_blocks=16)  # two prompts of 6 blocks start, each grows to 10: one is preempted
    try:
        assert [c.token_ids for c in eng.generate(prompts, long)] == want
        assert eng.scheduler.num_preemptions > 0
        assert tier.puts > 0 and eng.blocks.tier.hits > 0  # preempted blocks evicted to the tier, loaded on re-admission
        assert_whole(eng)
    finally:
        tier.close()


def test_the_tier_needs_the_prefix_cache(tiny, own_shm_dir):
    from pdserve_client.errors import InvalidRequestError

    conf = EngineConfig(num_blocks=14, block_size=BS, prefix_cache=False, kv_host_tier_bytes=2**20)
    eng = LLMEngine.load(str(tiny), conf, progress=False, tokenizer=False)
    with pytest.raises(InvalidRequestError, match="needs the prefix cache"):
        host_tier.attach(eng, conf, str(tiny))
    assert host_tier.attach(eng, EngineConfig(num_blocks=14, block_size=BS), str(tiny)) is None  # 0 MiB: off
