"""The prefix cache: keyed 128-bit block keys, the block manager's keys, token confirmation, ref
counts and LRU eviction as plain data (forced key collisions never share KV), and the
single-process engine on a tiny random model giving the same greedy tokens with the cache as
without it (shared prefixes, chunked prefill, n copies of one prompt, preemption, an abort
mid-prefill, every key colliding), with every pool whole and every cached block's ref count zero at the end."""
import hashlib
from array import array

import pytest

from pdserve.common.prefix_hash import ROOT_HASH, SALT_PERSON, chain_hashes, new_secret, root_hash
from pdserve.runtime import kv_cache
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.kv_cache import BlockManager
from pdserve_client.params import SamplingParams
from tests.helpers import force_colliding_keys, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SECRET = b"s" * 32


def test_keys_are_keyed_128_bit_chains():
    a = chain_hashes(list(range(40)), 8, SECRET)
    assert len(a) == 5 and len(set(a)) == 5 and all(isinstance(k, bytes) and len(k) == 16 for k in a)
    assert chain_hashes(list(range(40)), 8, SECRET, upto_blocks=2) == a[:2]
    assert chain_hashes(list(range(40)), 8, SECRET, known=a[:3]) == a
    b = chain_hashes([99] + list(range(1, 40)), 8, SECRET)
    assert b[0] != a[0] and all(x != y for x, y in zip(a, b))  # a change early changes every later key
    # the same in every process given the secret: BLAKE2b keyed with it over the previous key and the tokens
    want = hashlib.blake2b(ROOT_HASH + array("q", range(8)).tobytes(), digest_size=16, key=SECRET).digest()
    assert a[0] == want
    other = chain_hashes(list(range(40)), 8, new_secret())  # another deployment's secret: no key in common
    assert not set(other) & set(a)
    assert new_secret() != new_secret() and len(new_secret()) == 32


def test_a_cache_salt_starts_its_own_chain():
    """No salt: today's root (unsalted requests share as before); a salt: a root of its own, keyed
    with the secret in a domain apart from block keys; the same salt gives the same keys, another
    salt or none shares not one key."""
    toks = list(range(40))
    assert root_hash(SECRET) == root_hash(SECRET, None) == ROOT_HASH
    assert chain_hashes(toks, 8, SECRET, salt=None) == chain_hashes(toks, 8, SECRET)
    a = root_hash(SECRET, "tenant-a")
    assert a == hashlib.blake2b(b"tenant-a", digest_size=16, key=SECRET, person=SALT_PERSON).digest()
    assert len({ROOT_HASH, a, root_hash(SECRET, "tenant-b"), root_hash(new_secret(), "tenant-a")}) == 4
    salted = chain_hashes(toks, 8, SECRET, salt="tenant-a")
    assert salted[0] == hashlib.blake2b(a + array("q", range(8)).tobytes(), digest_size=16, key=SECRET).digest()
    assert salted == chain_hashes(toks, 8, SECRET, salt="tenant-a")
    assert chain_hashes(toks, 8, SECRET, known=salted[:2], salt="tenant-a") == salted
    for other in (chain_hashes(toks, 8, SECRET), chain_hashes(toks, 8, SECRET, salt="tenant-b")):
        assert not set(other) & set(salted)
    assert root_hash(SECRET, "\ud800") != ROOT_HASH  # even a lone surrogate hashes (no UnicodeEncodeError in a worker)


def test_salted_blocks_match_only_the_same_salt():
    bm = BlockManager(8, 4)
    toks = list(range(12))
    t = bm.allocate(3)
    bm.register(t, chain_hashes(toks, 4, bm.prefix_key, salt="a"), 0, toks)
    bm.free_table(list(t))
    assert bm.match_tokens(toks, 3, "b") == [] and bm.match_tokens(toks, 3) == [] and bm.mismatches == 0
    got = bm.match_tokens(toks, 3, "a")
    assert got == t and bm.mismatches == 0  # confirmed against tokens and parents as any hit
    bm.free(got)
    assert bm.free_blocks == 8 and bm.leaked() == []


def blocks_with_keys(tokens, bm):
    return chain_hashes(tokens, bm.block_size, bm.prefix_key), tokens


def test_register_match_and_lru_eviction():
    bm = BlockManager(4, 4)
    keys, toks = blocks_with_keys(list(range(12)), bm)
    t = bm.allocate(3)
    bm.register(t, keys, 0, toks)
    assert bm.cached_blocks == 3 and bm.free_blocks == 1
    bm.free_table(list(t))  # counts zero: kept, evictable, still free
    assert bm.free_blocks == 4 and bm.leaked() == []
    got = bm.match(keys[:2] + [bytes(16)], toks)
    assert got == t[:2] and bm.free_blocks == 2  # taken: count 1, not evictable
    other = bm.allocate(2)  # the never-registered block first, then the least recently freed cached one
    assert t[2] in other  # t[2] was freed first (free_table frees last blocks first)
    assert bm.by_hash.get(keys[2]) is None and bm.cached_blocks == 2
    bm.free(got)
    bm.free(other)
    assert bm.free_blocks == 4 and bm.leaked() == []
    added, evicted = bm.take_changes()
    assert set(added) == set(keys[:2]) and evicted == [keys[2]]
    assert bm.take_changes() == ([], [])
    assert bm.match_tokens(list(range(12)), 3) == t[:2] and bm.mismatches == 0
    bm.free(t[:2])


def test_off_registers_and_matches_nothing():
    bm = BlockManager(4, 4, prefix_cache=False)
    keys, toks = blocks_with_keys(list(range(8)), bm)
    t = bm.allocate(2)
    bm.register(t, keys, 0, toks)
    bm.free(t)
    assert bm.match(keys, toks) == [] and bm.match_tokens(toks, 2) == [] and bm.cached_blocks == 0


def test_duplicate_key_leaves_second_block_unregistered_but_linked():
    bm = BlockManager(6, 4)
    keys, toks = blocks_with_keys(list(range(12)), bm)
    a, b = bm.allocate(1), bm.allocate(3)
    bm.register(a, keys[:1], 0, toks)
    bm.register(b, keys[:1], 0, toks)  # the same first block computed twice at once
    assert bm.by_hash[keys[0]] == a[0] and bm.hash_of[b[0]] is None
    bm.register(b, keys, 1, toks[4:])  # its later blocks register, chained to the equal block a[0]
    assert bm.hash_of[b[1]] == keys[1] and bm.hash_of[b[2]] == keys[2]
    bm.free(a + b)
    assert bm.match(keys, toks) == [a[0], b[1], b[2]] and bm.mismatches == 0
    bm.free([a[0], b[1], b[2]])
    assert bm.free_blocks == 6 and bm.leaked() == []


@pytest.fixture
def colliding(monkeypatch):
    return force_colliding_keys(monkeypatch)


def test_colliding_keys_never_share_kv(colliding):
    bm = BlockManager(8, 4)
    victim = [1, 2, 3, 4, 5, 6, 7, 8]
    t = bm.allocate(2)
    keys = kv_cache.chain_hashes(victim, 4, bm.prefix_key)
    assert keys[0] == keys[1]
    bm.register(t, keys, 0, victim)
    assert bm.hash_of[t[0]] == keys[0] and bm.hash_of[t[1]] is None  # its second key was taken (by a different block)
    assert bm.mismatches == 1
    bm.free(t)
    assert bm.match_tokens([9, 9, 9, 9, 5, 6, 7, 8, 0], 2) == []  # the key found, the tokens differ: a miss
    assert bm.mismatches == 2
    # the first block repeated: its second copy has the first's key and tokens but not its parent
    assert bm.match_tokens([1, 2, 3, 4, 1, 2, 3, 4, 0], 2) == [t[0]] and bm.mismatches == 3
    bm.free([t[0]])
    assert bm.free_blocks == 8 and bm.leaked() == []


def test_new_secret_forgets_every_registration():
    bm = BlockManager(4, 4)
    toks = list(range(8))
    t = bm.allocate(2)
    keys, _ = blocks_with_keys(toks, bm)
    bm.register(t, keys, 0, toks)
    bm.free(t[1:])  # t[0] still held
    bm.set_prefix_key(new_secret())
    assert bm.cached_blocks == 0 and bm.take_changes() == ([], [])
    assert bm.match_tokens(toks, 2) == [] and bm.free_blocks == 3
    bm.free(t[:1])
    assert bm.free_blocks == 4 and bm.leaked() == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=256)
    return d


def engine(path, cache=True, **kw):
    conf = dict(num_blocks=96, block_size=8, prefix_cache=cache)
    conf.update(kw)
    return LLMEngine.load(str(path), EngineConfig(**conf), progress=False, tokenizer=False)


SYSTEM = [5 + (j * 11) % 400 for j in range(37)]  # a shared "system prompt" of 4 full blocks and a part


def shared_prompts():
    return [SYSTEM + [7 + (i * 17 + j * 5) % 450 for j in range(n)] for i, n in enumerate([3, 20, 1, 9, 31])]


def assert_whole(eng):
    assert eng.blocks.free_blocks == eng.blocks.num_blocks
    assert eng.blocks.leaked() == []


def run_each(eng, prompts, params=GREEDY):
    """One prompt after the other (the later ones find the earlier ones' blocks cached)."""
    return [eng.generate([p], params)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny):
    eng = engine(tiny, cache=False)
    out = run_each(eng, shared_prompts())
    assert eng.blocks.hits == 0 and eng.blocks.cached_blocks == 0
    return out


def test_shared_prefix_same_tokens_and_hits(tiny, reference):
    eng = engine(tiny)
    assert run_each(eng, shared_prompts()) == reference
    assert eng.blocks.hits >= 4 * 8 * 4  # every later prompt found the 4 full system blocks
    assert eng.blocks.cached_blocks > 0
    assert_whole(eng)
    assert run_each(eng, shared_prompts()) == reference  # again: whole prompts (but the last token) cached
    assert_whole(eng)


def test_batched_and_chunked_prefill_same_tokens(tiny, reference):
    eng = engine(tiny, max_num_batched_tokens=16)
    run_each(eng, shared_prompts()[:1])  # warm the system prompt
    assert [c.token_ids for c in eng.generate(shared_prompts(), GREEDY)] == reference
    assert eng.blocks.hits > 0
    assert_whole(eng)


def test_n_copies_of_one_prompt(tiny, reference):
    eng = engine(tiny)
    p = shared_prompts()[1]
    out = [c.token_ids for c in eng.generate([p] * 4, GREEDY)]
    assert out == [reference[1]] * 4
    out = [c.token_ids for c in eng.generate([p] * 4, GREEDY)]  # now every copy shares the cached prompt
    assert out == [reference[1]] * 4
    assert eng.blocks.hits >= 4 * (len(p) - 1) // 8 * 8
    assert_whole(eng)


def test_burst_sharing_a_prefix_computes_it_once(tiny, reference):
    eng = engine(tiny)
    assert [c.token_ids for c in eng.generate(shared_prompts(), GREEDY)] == reference
    assert eng.blocks.hits == 4 * (len(SYSTEM) // 8 * 8)  # the 4 later prompts deferred one step, then hit
    assert_whole(eng)
    off = engine(tiny, cache=False)
    assert [c.token_ids for c in off.generate(shared_prompts(), GREEDY)] == reference and off.blocks.hits == 0


def test_preemption_same_tokens(tiny, reference):
    eng = engine(tiny, num_blocks=24)  # 5 prompts of 5-9 blocks each cannot run at once
    run_each(eng, shared_prompts()[:1])
    assert [c.token_ids for c in eng.generate(shared_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))] == reference
    assert eng.scheduler.num_preemptions > 0
    assert_whole(eng)


def test_abort_mid_prefill_keeps_counts(tiny, reference):
    eng = engine(tiny, max_num_batched_tokens=8)
    long = shared_prompts()[4]
    seq = eng.add_request(long, GREEDY)
    eng.step()
    eng.step()  # two chunks computed: two full blocks registered
    assert 0 < seq.num_computed_tokens < len(long)
    assert eng.blocks.cached_blocks == 2
    assert eng.abort(seq.request_id)
    assert_whole(eng)
    assert run_each(eng, shared_prompts()) == reference  # the aborted prompt's blocks are reused
    assert eng.blocks.hits >= 2 * 8
    assert_whole(eng)


def test_prefill_mode_reuses_its_cache(tiny, reference):
    eng = LLMEngine.load(str(tiny), EngineConfig(num_blocks=96, block_size=8), progress=False, tokenizer=False)
    eng.prefill_only = True
    first = [c.token_ids for c in eng.generate(shared_prompts(), GREEDY)]
    assert [t[:1] for t in reference] == first
    # one burst: the first prompt computes the system blocks, the others wait a step and find them
    assert eng.blocks.hits == 4 * (len(SYSTEM) // 8 * 8)
    assert [c.token_ids for c in eng.generate(shared_prompts(), GREEDY)] == first
    assert eng.blocks.hits >= sum((len(p) - 1) // 8 * 8 for p in shared_prompts())  # released blocks stay cached
    assert_whole(eng)


def test_cache_salt_shares_only_within_a_salt(tiny, reference):
    """The engine's scheduler keys each sequence from its params' cache_salt: a prompt run again
    with its salt hits, with another salt or none it hits nothing, and unsalted prompts share with
    each other as before; the tokens are the cache-off ones throughout."""
    eng = engine(tiny)
    p = shared_prompts()[3]
    blocks = (len(p) - 1) // 8

    def run(salt):
        before = eng.blocks.hits
        out = eng.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, cache_salt=salt))[0].token_ids
        assert out == reference[3]
        return eng.blocks.hits - before

    assert run("a") == 0
    assert run("a") == blocks * 8
    assert run("b") == 0 and run(None) == 0
    assert run(None) == blocks * 8 and run("b") == blocks * 8
    assert_whole(eng)


def test_no_prefix_cache_switch_reaches_workers():
    from click.testing import CliRunner

    from pdserve.cli import main
    from pdserve.flags import worker_args

    assert worker_args({"no_prefix_cache": True}) == ["--no-prefix-cache"]
    assert worker_args({"no_prefix_cache": True, "block_size": 8}) == ["--block-size", "8", "--no-prefix-cache"]
    assert worker_args({"no_prefix_cache": None}) == []
    for cmd in ("launch", "prefill", "decode"):
        help_text = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "--no-prefix-cache" in help_text, cmd


def test_every_key_colliding_same_tokens(tiny, reference, colliding):
    """With every block key forced equal, each prompt still gets its own KV: the engine's greedy
    tokens equal the cache-off ones, the collisions are counted, and the pool is whole."""
    eng = engine(tiny)
    assert run_each(eng, shared_prompts()) == reference
    assert [c.token_ids for c in eng.generate(shared_prompts(), GREEDY)] == reference
    assert eng.blocks.mismatches > 0 and eng.blocks.cached_blocks == 1
    assert_whole(eng)
