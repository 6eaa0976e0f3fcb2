"""A model whose every layer slides keeps only its window's KV blocks (runtime.kv_cache
drop_outside_window), and a hand-off sends only those; a model whose sliding layers sit beside
full ones (Gemma 2 / 3: KV groups, runtime.kv_groups) does so for its sliding groups.

A tiny random Mistral with sliding_window 16, blocks of 4 tokens: a generation of 200 tokens holds
at most ceil(16 / 4) + 1 = 5 blocks a sequence at any step, in a pool of 16 blocks that could not
hold one such sequence whole, and its greedy tokens equal HF's; preemption, abort and the prefix
cache keep the pool whole and the tokens right; prefill -> decode in one process moves only the
window's blocks and decodes as HF. Random Gemma 2 (4 layers) and Gemma 3 (12 layers, 5:1)
checkpoints with windows of 8: each sequence holds its full group's blocks and each sliding
group's window only, greedy tokens equal HF's, and a hand-off moves only those blocks.
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
from pdserve.runtime.kv_cache import NULL_BLOCK, BlockManager, deinterleave
from pdserve.runtime.kv_groups import kv_groups
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


def decode_handed_off(dec: Worker, inbox: list) -> dict[str, list[int]]:
    """Give the decode worker what the hand-offs sent it and run it dry; the tokens it emitted, by request."""
    dec.link.inbox += inbox
    inbox.clear()
    while dec.link.inbox or dec.engine.has_work():
        dec.turn(0)
    got: dict[str, list[int]] = {}
    for batch in dec.link.taken(TokenBatch):
        for item in batch.items:
            if item.token_id >= 0:
                got.setdefault(item.request_id, []).append(item.token_id)
    return got


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
    got = decode_handed_off(dec, inbox)
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


# ------------------------------------------------------------------ KV groups: sliding layers beside full ones

# Gemma 2: every other layer slides (4 layers: 2 groups of 2); Gemma 3: five of each six slide
# (12 layers: a full group of 2 and 5 sliding groups of 2). Windows of 8 keys, blocks of 4 tokens.
GEMMA_WINDOW = 8
GEMMAS = {
    "gemma2": dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW, attn_logit_softcapping=4.0,
                   final_logit_softcapping=4.0, num_hidden_layers=4),
    "gemma3": dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW, num_hidden_layers=12,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, final_logit_softcapping=4.0),
}
GEMMA_GROUPS = {"gemma2": (0, GEMMA_WINDOW), "gemma3": (0,) + (GEMMA_WINDOW,) * 5}
GEMMA_NEW = 40


@pytest.fixture(scope="module", params=sorted(GEMMAS))
def gemma(request, tmp_path_factory):
    """(name, checkpoint, prompts of 30 and 45 tokens, HF's greedy GEMMA_NEW tokens after each)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp(request.param)
    save_tiny_model(d, **GEMMAS[request.param])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (30, 45)]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return request.param, d, prompts, [hf_greedy(hf, p, GEMMA_NEW, eos=False) for p in prompts]


def held_by_design(blocks, computed: int) -> int:
    """Blocks a sequence with `computed` tokens computed holds: every full group's table whole,
    each sliding group's from its window on (runtime.kv_cache first_needed)."""
    n = blocks.blocks_for(computed)
    return sum(n - first for first in blocks.first_needed_by_group(computed))


def test_layers_split_into_kv_groups_of_one_window():
    assert kv_groups((8, 0) * 2, 4).layers == ((1, 3), (0, 2))  # Gemma 2: a full group, a sliding one
    g3 = kv_groups(((8,) * 5 + (0,)) * 2, 12)
    assert g3.size == 2 and g3.windows == (0,) + (8,) * 5 and g3.layers[0] == (5, 11)
    assert sorted(layer for group in g3.layers for layer in group) == list(range(12))
    assert all(g3.layers[g3.group_of[i]][g3.slot_of[i]] == i for i in range(12))
    uneven = kv_groups(((8,) * 5 + (0,)) * 4 + (8, 8), 26)  # Gemma 3 1B: 4 full, 22 sliding
    assert uneven.size == 4 and [len(ls) for ls in uneven.layers] == [4, 4, 4, 4, 4, 4, 2]  # the last group's slots half used
    assert not kv_groups((), 6).split and kv_groups((), 6).size == 6  # every layer full: one group, today's pool
    base = dict(architecture="Gemma2ForCausalLM", max_position=128, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                num_heads=2, num_kv_heads=1, head_dim=16)
    assert ModelConfig(**base, layer_windows=(8, 0, 8, 0)).kv_groups.windows == (0, 8)
    assert not ModelConfig(**base, layer_windows=(8, 8, 8, 8)).kv_groups.split  # every layer slides: one table, kv_window
    assert not ModelConfig(**base, layer_windows=(8, 16, 8, 16)).kv_groups.split  # different windows, none full: likewise


def test_a_group_manager_frees_only_the_sliding_groups_blocks():
    bm = BlockManager(64, BS, group_windows=(0, WINDOW, WINDOW))
    assert bm.groups == 3 and not bm.prefix_cache  # not built for KV groups
    tables = bm.new_tables()
    assert bm.ensure_tables(tables, 41) and [len(t) for t in tables] == [11] * 3 and bm.free_blocks == 64 - 33
    assert bm.drop_outside_windows(tables, 40) == 2 * 6  # each sliding group's blocks 0..5; the full group keeps all
    assert tables[0].count(NULL_BLOCK) == 0 and tables[1][:6] == [NULL_BLOCK] * 6 and bm.held_by(tables) == 11 + 2 * 5
    assert not bm.ensure_tables(tables, 41 + 4 * 20)  # 3 x 20 more: short, nothing taken
    assert bm.held_by(tables) == 21 and bm.free_blocks == 64 - 21
    flat = bm.interleave(tables)
    assert flat[:3] == [tables[0][0], NULL_BLOCK, NULL_BLOCK] and deinterleave(flat, 3) == tables
    bm.free_tables(tables)
    assert bm.free_blocks == 64 and bm.leaked() == [] and tables == [[], [], []]


def test_table_blocks_bounds_what_a_sequence_computed_in_chunks_holds():
    """The scheduler's and validate's bound (a prompt that can never fit is refused, one that
    can is kept): over windows, block sizes, chunks and lengths, a sliding group's table never
    holds more than table_blocks counts for it."""
    for bs, w, chunk in [(4, 8, 16), (4, 3, 5), (1, 5, 2), (8, 33, 31), (16, 8, 1), (2, 16, 16)]:
        bm = BlockManager(4096, bs, group_windows=(0, w))
        for total in range(1, 120, 7):
            tables, computed, most = bm.new_tables(), 0, 0
            while computed < total:
                n = min(chunk, total - computed)
                assert bm.ensure_tables(tables, computed + n)
                most = max(most, bm.held_by(tables[1:]))
                computed += n
                bm.drop_outside_windows(tables, computed)
            assert most <= bm.table_blocks(total, chunk) - bm.blocks_for(total), (bs, w, chunk, total)
            bm.free_tables(tables)
        assert bm.free_blocks == 4096


def test_a_grant_for_kv_groups_leaves_out_each_sliding_groups_positions_before_its_window():
    bm = BlockManager(64, BS, group_windows=(0, WINDOW))
    ids, cached = grant_blocks(bm, Admit("a", 40, 1))
    full, sliding = deinterleave(ids, 2)
    assert cached == 0 and len(full) == len(sliding) == 10 and NULL_BLOCK not in full
    assert sliding[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in sliding[6:] and bm.free_blocks == 64 - 14
    bm.free(ids)
    assert bm.free_blocks == 64


def test_a_gemma_generation_frees_its_sliding_groups_blocks(gemma):
    """Gemma 2 and 3, prompts of 30 and 45 tokens past their windows of 8, GEMMA_NEW tokens each,
    batched: after every step each sequence holds its full group's blocks and each sliding
    group's window only (held_by_design: fewer than one table for every layer would), the
    pool's count agrees, the tokens are HF's and the pool is whole at the end."""
    name, d, prompts, refs = gemma
    eng = engine(d, num_blocks=256)
    assert eng.blocks.group_windows == GEMMA_GROUPS[name] and eng.runner.kv_cache.shape[0] == 2
    fewer = []

    def check(running):
        held = [eng.blocks.held_by(s.block_tables) for s in running]
        assert held == [held_by_design(eng.blocks, s.num_computed_tokens) for s in running]
        assert eng.blocks.num_blocks - eng.blocks.free_blocks == sum(held)
        fewer.extend(h < eng.blocks.table_blocks(s.num_computed_tokens) for h, s in zip(held, running))

    outs = run(eng, prompts, SamplingParams(temperature=0, max_tokens=GEMMA_NEW, ignore_eos=True), check)
    assert fewer and all(fewer), "a sliding group kept blocks before its window"
    assert eng.blocks.window_freed > 0
    for i, (tokens, logits) in enumerate(refs):
        assert assert_greedy_equal(outs[i], tokens, logits, f"{name} prompt {i}") >= GEMMA_NEW - 8
    assert whole(eng)


@pytest.mark.timeout(300)  # the tight pool preempts and recomputes the longer sequence about ten times
def test_gemma_preemption_and_chunked_prefill_keep_the_pool_whole_and_the_tokens(gemma):
    """A pool too small for both sequences at once, prompts in chunks of 16 tokens: preempted and
    recomputed, the same tokens as a roomy pool, and every block back."""
    name, d, prompts, _ = gemma
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = run(engine(d, num_blocks=256), prompts, params)
    # at their ends (54 and 69 tokens) they hold 14 + 3 and 18 + 3 blocks (Gemma 2) or 14 + 5 x 3 and 18 + 5 x 3 (Gemma 3);
    # the longer alone, in 16-token chunks, at most 18 + 7 or 18 + 5 x 7 (BlockManager.table_blocks)
    eng = engine(d, num_blocks={"gemma2": 30, "gemma3": 56}[name], max_num_batched_tokens=16)
    assert run(eng, prompts, params) == want
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.window_freed > 0 and whole(eng)


@pytest.mark.parametrize("stream", [False, True])
def test_a_gemma_hand_off_sends_the_sliding_groups_window_only(gemma, stream):
    """Prefill worker -> decode worker in one process (kvtransfer.local): the grant leaves each
    sliding group's positions before its window out, only the rest moves (streamed per 16-token
    chunk, or all with the KVReady), the decode side decodes as HF and both pools end whole."""
    name, d, prompts, refs = gemma
    groups = len(GEMMA_GROUPS[name])
    kv = LocalKV()
    d_engine, d_pool = tiny_engine(d, block_size=BS, num_blocks=256)
    dec = Worker("decode-1", d_engine, kv, FakeLink())
    inbox = kv.register("local://decode-1", d_pool)
    p_engine, p_pool = tiny_engine(d, prefill_only=True, block_size=BS, num_blocks=256, max_num_batched_tokens=16)
    pre = PrefillWorker("prefill-1", p_engine, p_pool, kv, FakeLink(), handoff_stream=stream)
    params = SamplingParams(temperature=0, max_tokens=GEMMA_NEW, ignore_eos=True)
    sent = whole_tables = 0
    for rid, prompt in zip("ab", prompts):
        dec.link.inbox.append(Admit(rid, len(prompt), 1))
        dec.turn(0)
        ids = [m for m in dec.link.taken(Granted) if m.request_id == rid][-1].block_ids
        need = d_engine.blocks.blocks_for(len(prompt))
        tables = deinterleave(ids, groups)
        assert [t.count(NULL_BLOCK) for t in tables] == list(d_engine.blocks.first_needed_by_group(len(prompt)))
        sent += len(ids) - ids.count(NULL_BLOCK)
        whole_tables += groups * need
        pre.link.inbox.append(Prefill(rid, prompt, params, "decode-1", "local://decode-1", ids))
    while pre.jobs or pre.link.inbox:
        pre.turn(0)
    assert kv.bytes_sent == sent * block_bytes(p_pool) and sent < whole_tables
    assert whole(p_engine)
    got = decode_handed_off(dec, inbox)
    for rid, (tokens, logits) in zip("ab", refs):
        assert assert_greedy_equal(got[rid], tokens, logits, f"{name} handed-off {rid}") >= GEMMA_NEW - 8
    assert whole(d_engine) and not dec.grants and not d_engine.seqs
