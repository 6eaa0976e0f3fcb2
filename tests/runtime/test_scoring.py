"""Prompt logprobs in the engine (runtime/scoring.py): the batched `score` equals its one-row twin;
an engine's prompt scores equal a teacher-forced transformers pass of the same checkpoint, whether
the prompt is computed in one step or in chunks, while the prefix cache holds its prefix (a scoring
prompt never takes cached blocks), after a preemption (scored once, not twice), and in prefill
mode (handed out with the first token); the pool is whole at the end."""
import pytest
import torch

from pdserve.runtime.kv_cache import BlockManager
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.scoring import SCORE_CHUNK, score, score_reference
from pdserve.runtime.sequence import Sequence
from pdserve_client.params import SamplingParams
from tests.helpers import save_tiny_model, tiny_engine

ATOL = 1e-4


def test_score_equals_its_one_row_twin():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g) * 3
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie at the top
    targets, ks = [1, 5, 9, 0, 49, 3, 3], [0, 1, 5, 20, 2, 0, 60]
    fast, slow = score(logits, targets, ks), score_reference(logits, targets, ks)
    for (lp, rank, top), (rlp, rrank, rtop) in zip(fast, slow):
        assert lp == pytest.approx(rlp, abs=1e-6) and rank == rrank
        top, rtop = (sorted(x, key=lambda p: (-round(p[1], 5), p[0])) for x in (top, rtop))  # tied ids may come in either order
        assert [t for t, _ in top] == [t for t, _ in rtop] and [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-6)
    assert [len(top) for _, _, top in fast] == [0, 1, 5, 20, 2, 0, 50]
    assert fast[2][1] == 1  # tied for the top with another id: rank 1 (only strictly greater logprobs count)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    cfg = save_tiny_model(d, max_position_embeddings=1024)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()

    def reference(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return d, cfg["vocab_size"], reference


def prompt(vocab, n, seed):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(scores, ids, ref, k):
    assert len(scores) == len(ids) - 1
    for i, (lp, rank, top) in enumerate(scores):
        assert lp == pytest.approx(float(ref[i, ids[i + 1]]), abs=ATOL)
        own = ref[i, ids[i + 1]]
        assert 1 + int((ref[i] > own + ATOL).sum()) <= rank <= 1 + int((ref[i] > own - ATOL).sum())  # exact but for near-ties
        assert [t for t, _ in top] == ref[i].topk(k).indices.tolist()


def test_engine_scores_equal_teacher_forcing_chunked_cached_and_preempted(tiny):
    d, vocab, reference = tiny
    engine, _ = tiny_engine(d, num_blocks=48, block_size=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    long_ids = prompt(vocab, SCORE_CHUNK + 30, 1)  # over the chunk: two steps
    [c] = engine.generate([long_ids[:40]], SamplingParams(temperature=0, max_tokens=1))  # its prefix now in the prefix cache
    assert c.prompt_logprobs is None and engine.blocks.cached_blocks > 0
    short = prompt(vocab, 9, 2)
    first, second = engine.generate([long_ids[:60], short], params)  # the first shares 40 cached tokens: still scored whole
    check(first.prompt_logprobs, long_ids[:60], reference(long_ids[:60]), 3)
    check(second.prompt_logprobs, short, reference(short), 3)
    engine, _ = tiny_engine(d, num_blocks=48, block_size=8, max_num_batched_tokens=2048)
    [c] = engine.generate([long_ids], params)  # 286 tokens: SCORE_CHUNK a step although the budget allows all
    check(c.prompt_logprobs, long_ids, reference(long_ids), 3)
    assert [n for _, n, _, _ in engine.step_log][:2] == [SCORE_CHUNK, len(long_ids) - SCORE_CHUNK]
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_preempted_sequence_is_scored_once(tiny):
    d, vocab, reference = tiny
    engine, _ = tiny_engine(d, num_blocks=10, block_size=8, max_num_batched_tokens=256, prefix_cache=False)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    ids = [prompt(vocab, 20, 3), prompt(vocab, 20, 4)]  # 2 x (20 + 30) tokens in 10 blocks of 8: one is preempted
    outs = engine.generate(ids, params)
    assert engine.scheduler.num_preemptions >= 1
    for c, p in zip(outs, ids):
        check(c.prompt_logprobs, p, reference(p), 1)
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_prefill_mode_hands_scores_out_with_the_first_token(tiny):
    d, vocab, reference = tiny
    engine, _ = tiny_engine(d, prefill_only=True)
    ids = prompt(vocab, 17, 5)
    [c] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0))
    assert len(c.token_ids) == 1
    check(c.prompt_logprobs, ids, reference(ids), 0)
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_scheduler_never_gives_a_scoring_prompt_cached_blocks():
    blocks = BlockManager(16, 4, prefix_cache=True)
    sched = Scheduler(blocks, 8, 64)
    seq = Sequence("a", list(range(12)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    sched.add(seq)
    out = sched.schedule()
    assert out.scheduled == [(seq, 12)] and seq.num_computed_tokens == 0
