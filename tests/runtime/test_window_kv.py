"""A model whose every layer slides keeps only its window's KV blocks (runtime.kv_cache
drop_outside_window), and a hand-off sends only those.

A tiny random Mistral with sliding_window 16, blocks of 4 tokens: a generation of 200 tokens holds
at most ceil(16 / 4) + 1 = 5 blocks a sequence at any step, in a pool of 16 blocks that could not
hold one such sequence whole, and its greedy tokens equal HF's; preemption, abort and the prefix
cache keep the pool whole and the tokens right; prefill -> decode in one process moves only the
window's blocks and decodes as HF.
"""
from __future__ import annotations

import pytest
import torch

from pdserve.decode.grants import grant_blocks
from pdserve.kvtransfer.heads import block_bytes
from pdserve.kvtransfer.local import LocalKV
from pdserve.prefill.fixed_worker import PrefillWorker
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.kv_cache import NULL_BLOCK, BlockManager
from pdserve.wire.protocol import Admit, Granted, Prefill, TokenBatch, WorkerError
from pdserve.worker.any_role import Worker
from pdserve_client.params import SamplingParams
from tests.helpers import FakeLink, assert_greedy_equal, hf_greedy, save_tiny_model, tiny_engine

WINDOW, BS = 16, 4
MOST_HELD = -(-WINDOW // BS) + 1  # the window's blocks and the one being filled
LONG = 200


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    d = tmp_path_factory.mktemp("mistral-window")
    cfg = save_tiny_model(d, arch="mistral", sliding_window=WINDOW)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in (5, 40)]  # within and past the window
    return d, prompts


@pytest.fixture(scope="module")
def hf_refs(mistral):
    """HF's greedy tokens: LONG after the long prompt, 40 after the short one (HF's generate is
    the slow part of this module)."""
    from transformers import AutoModelForCausalLM

    d, prompts = mistral
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return [hf_greedy(hf, p, n, eos=False) for p, n in zip(prompts, (40, LONG))]


def engine(d, **config) -> LLMEngine:
    return LLMEngine.load(str(d), EngineConfig(**{"num_blocks": 16, "block_size": BS, **config}), progress=False, tokenizer=False)


def whole(eng) -> bool:
    return eng.blocks.free_blocks == eng.blocks.num_blocks and eng.blocks.leaked() == []


def run(eng, prompts, params, each_step=None) -> list[list[int]]:
    seqs = [eng.add_request(p, params) for p in prompts]
    out = {s.request_id: [] for s in seqs}
    while eng.has_work():
        for o in eng.step():
            if o.token_id is not None:
                out[o.request_id].append(o.token_id)
        if each_step is not None:
            each_step([s for s in seqs if not s.finished])
    return [out[s.request_id] for s in seqs]


# ------------------------------------------------------------------ the block manager alone

def test_blocks_wholly_before_the_window_are_freed_and_the_pool_stays_whole():
    bm = BlockManager(32, BS, window=WINDOW)
    assert [bm.first_needed(n) for n in (0, 15, 16, 19, 20, 40)] == [0, 0, 0, 1, 1, 6]  # (n - 15) // 4, at 40: 6
    table = []
    assert bm.ensure_slots(table, 41)
    assert bm.drop_outside_window(table, 40) == 6 and table[:7].count(NULL_BLOCK) == 6 and bm.held(table) == 5
    assert bm.drop_outside_window(table, 40) == 0  # done already
    assert bm.free_blocks == 32 - 5 and bm.window_freed == 6
    assert bm.ensure_slots(table, 45) and bm.drop_outside_window(table, 44) == 1
    bm.free_table(table)  # NULL entries hold nothing
    assert bm.free_blocks == 32 and bm.leaked() == []
    # a window shorter than a block keeps the block before the one being filled (its link chains the next key)
    small = BlockManager(8, BS, window=2)
    assert [small.first_needed(n) for n in (4, 8, 9, 12)] == [0, 1, 1, 2]
    assert BlockManager(8, BS).first_needed(100) == 0  # no window: nothing is ever freed


def test_a_table_with_a_freed_entry_registers_nothing_after_it():
    bm = BlockManager(16, BS, window=WINDOW)
    tokens = list(range(100, 140))
    table = bm.allocate(10)
    hashes = [bytes([k]) * 16 for k in range(10)]
    bm.register([NULL_BLOCK, *table[1:]], hashes, 0, tokens)
    assert bm.cached_blocks == 0
    bm.register(table, hashes[:5], 0, tokens[:20])
    bm.drop_outside_window(table, 40)
    bm.register(table, hashes, 5, tokens[20:])  # block 4 was freed: its link is not read
    assert bm.cached_blocks == 5
    bm.free_table(table)
    assert bm.free_blocks == 16


def test_only_a_model_whose_every_layer_slides_frees_blocks():
    base = dict(architecture="MistralForCausalLM", max_position=128, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                num_heads=2, num_kv_heads=1, head_dim=16)
    assert ModelConfig(**base, layer_windows=(16, 16, 16)).kv_window == 16
    assert ModelConfig(**base, layer_windows=(8, 16, 8)).kv_window == 16  # the widest window
    assert ModelConfig(**base, layer_windows=(16, 0, 16)).kv_window == 0  # Gemma's full layers read every block
    assert ModelConfig(**base).kv_window == 0


def test_a_grant_leaves_out_the_positions_before_the_window():
    bm = BlockManager(32, BS, window=WINDOW)
    ids, cached = grant_blocks(bm, Admit("a", 40, 1))
    assert cached == 0 and len(ids) == 10 and ids[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in ids[6:]
    assert bm.free_blocks == 32 - 4  # 40 tokens' KV: blocks 6..9 (first_needed(40) = 6)
    bm.free(ids)
    assert bm.free_blocks == 32


# ------------------------------------------------------------------ the engine

def test_a_long_generation_holds_only_its_window(mistral, hf_refs):
    """200 tokens after prompts of 5 and 40, batched, in a pool of 16 blocks (64 tokens: not one
    whole sequence): never more than 5 blocks a sequence, the pool's count agrees, HF's tokens."""
    d, prompts = mistral
    eng = engine(d)
    most = []

    def check(running):
        held = [eng.blocks.held(s.block_table) for s in running]
        most.append(max(held, default=0))
        assert eng.blocks.num_blocks - eng.blocks.free_blocks == sum(held)

    outs = run(eng, prompts, SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True), check)
    assert max(most) <= MOST_HELD, f"a sequence held {max(most)} blocks"
    assert eng.blocks.window_freed >= 2 * (LONG // BS) - 10
    for i, (tokens, logits) in enumerate(hf_refs):
        assert assert_greedy_equal(outs[i][:len(tokens)], tokens, logits, f"prompt {i}") >= len(tokens) - 10
    assert eng.scheduler.num_preemptions == 0 and whole(eng)


def test_preemption_and_abort_keep_the_pool_whole_and_the_tokens(mistral):
    """Three sequences need 15 blocks at their windows' width, the pool has 12: some are
    preempted and recomputed in chunks of 16 tokens, each fitting; an abort after blocks were
    freed; the tokens equal the same engine's keeping every block in a large pool."""
    d, _ = mistral
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 9, 13)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    keep_all = engine(d, num_blocks=64)
    keep_all.blocks.window = 0  # the twin: every block kept
    want = run(keep_all, prompts, params)
    assert keep_all.blocks.window_freed == 0
    eng = engine(d, num_blocks=12, max_num_batched_tokens=16)
    assert run(eng, prompts, params) == want
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.window_freed > 0 and whole(eng)
    seq = eng.add_request(prompts[2], params)
    freed = eng.blocks.window_freed
    for _ in range(params.max_tokens // 2):
        eng.step()
    assert eng.blocks.window_freed > freed and NULL_BLOCK in seq.block_table and not seq.finished
    assert eng.abort(seq.request_id) and whole(eng)


def test_the_prefix_cache_serves_a_prompt_again(mistral, hf_refs):
    """The 40-token prompt twice: the second finds its prompt's blocks (freed, still cached) and
    keeps only the window's of them; both equal HF."""
    d, prompts = mistral
    eng = engine(d, num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = run(eng, prompts[1:], params)
    assert eng.blocks.hits == 0
    second = run(eng, prompts[1:], params)
    assert eng.blocks.hits == (len(prompts[1]) - 1) // BS * BS
    tokens, logits = hf_refs[1]
    for out in (first[0], second[0]):
        assert assert_greedy_equal(out, tokens[:12], logits, "prompt 1") == 12
    assert whole(eng)


# ------------------------------------------------------------------ the hand-off

def test_the_hand_off_sends_only_the_window(mistral, hf_refs):
    """Prefill worker -> decode worker in one process (kvtransfer.local): the grant leaves the
    positions before the window out, only the window's blocks move, and decoding equals HF."""
    d, prompts = mistral
    kv = LocalKV()
    d_engine, d_pool = tiny_engine(d, block_size=BS, num_blocks=16)
    dec = Worker("decode-1", d_engine, kv, FakeLink())
    inbox = kv.register("local://decode-1", d_pool)
    p_engine, p_pool = tiny_engine(d, prefill_only=True, block_size=BS, num_blocks=16)
    pre = PrefillWorker("prefill-1", p_engine, p_pool, kv, FakeLink())
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sent_blocks = 0
    for rid, prompt in zip("ab", prompts):
        dec.link.inbox.append(Admit(rid, len(prompt), 1))
        dec.turn(0)
        ids = [m for m in dec.link.taken(Granted) if m.request_id == rid][-1].block_ids
        first = d_engine.blocks.first_needed(len(prompt))
        assert ids[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in ids[first:]
        sent_blocks += len(ids) - first
        pre.link.inbox.append(Prefill(rid, prompt, params, "decode-1", "local://decode-1", ids))
    assert sent_blocks == 2 + 4  # 5 tokens: 2 blocks; 40 tokens: blocks 6..9 of 10
    while pre.jobs or pre.link.inbox:
        pre.turn(0)
    assert kv.bytes_sent == sent_blocks * block_bytes(p_pool)
    dec.link.inbox += inbox
    inbox.clear()
    while dec.link.inbox or d_engine.has_work():
        dec.turn(0)
    got: dict[str, list[int]] = {}
    for batch in dec.link.taken(TokenBatch):
        for item in batch.items:
            if item.token_id >= 0:
                got.setdefault(item.request_id, []).append(item.token_id)
    for rid, (tokens, logits) in zip("ab", hf_refs):
        assert assert_greedy_equal(got[rid], tokens[:40], logits, f"handed-off {rid}") == 40
    assert whole(p_engine) and whole(d_engine) and not dec.grants and not d_engine.seqs


def test_a_grant_that_wants_the_freed_blocks_fails_the_hand_off_at_once(mistral):
    """A grant (from a peer that does not leave the positions before the window out) asking for
    blocks the prefill side freed: the hand-off fails, the decode side is told, nothing leaks."""
    d, prompts = mistral
    kv = LocalKV()
    d_engine, d_pool = tiny_engine(d, block_size=BS, num_blocks=16)
    inbox = kv.register("local://decode-1", d_pool)
    p_engine, p_pool = tiny_engine(d, prefill_only=True, block_size=BS, num_blocks=16)
    pre = PrefillWorker("prefill-1", p_engine, p_pool, kv, FakeLink())
    pre.link.inbox.append(Prefill("a", prompts[1], SamplingParams(temperature=0, max_tokens=4), "decode-1", "local://decode-1",
                                  list(range(10))))
    pre.turn(0)
    assert [type(m).__name__ for m, _ in inbox] == ["KVFailed"] and kv.bytes_sent == 0
    assert [e.code for e in pre.link.taken(WorkerError)] == ["kv_transfer_failed"] and whole(p_engine)
