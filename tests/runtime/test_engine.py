"""The single-process engine on a tiny random model: chunked prefill, preemption and batching
leave greedy output unchanged, aborts and every other path free all blocks, bad requests get
typed errors before anything is queued."""
import pytest

from pdserve.common.errors import PromptTooLongError
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.errors import InvalidRequestError, InvalidSamplingParams
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason
from tests.helpers import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, max_position_embeddings=128)
    return d


def engine(path, **kw):
    conf = dict(num_blocks=64, block_size=8)
    conf.update(kw)
    return LLMEngine.load(str(path), EngineConfig(**conf), progress=False, tokenizer=False)


def prompts():
    return [[3 + (i * 7 + j * 13) % 500 for j in range(n)] for i, n in enumerate([5, 40, 1, 23, 64, 9])]


@pytest.fixture(scope="module")
def reference(tiny):
    eng = engine(tiny)
    return [eng.generate([p], GREEDY)[0].token_ids for p in prompts()]


def test_chunked_prefill_gives_same_tokens(tiny, reference):
    eng = engine(tiny, max_num_batched_tokens=16)
    out = [c.token_ids for c in eng.generate(prompts(), GREEDY)]
    assert out == reference
    assert eng.blocks.free_blocks == eng.blocks.num_blocks


def test_preemption_by_recompute_gives_same_tokens(tiny, reference):
    # 20 blocks of 8 tokens cannot hold all six sequences at full length: the newest get preempted.
    eng = engine(tiny, num_blocks=20)
    out = [c.token_ids for c in eng.generate(prompts(), GREEDY)]
    assert eng.scheduler.num_preemptions > 0
    assert out == reference
    assert eng.blocks.free_blocks == eng.blocks.num_blocks


def test_batch_cap_gives_same_tokens(tiny, reference):
    eng = engine(tiny, max_num_seqs=2)
    assert [c.token_ids for c in eng.generate(prompts(), GREEDY)] == reference


def test_abort_frees_blocks(tiny):
    eng = engine(tiny)
    a = eng.add_request(prompts()[1], GREEDY)
    b = eng.add_request(prompts()[4], GREEDY)
    eng.step()
    eng.step()
    assert eng.blocks.free_blocks < eng.blocks.num_blocks
    assert eng.abort(a.request_id)
    assert a.finish_reason == FinishReason.ABORT and a.block_table == []
    assert not eng.abort("no-such-request")
    while eng.has_work():
        eng.step()
    assert b.finish_reason == FinishReason.LENGTH
    assert eng.blocks.free_blocks == eng.blocks.num_blocks


def test_a_held_sequence_stops_after_its_prefill_beside_decoding_ones(tiny, reference):
    """add_request(hold=True): its first token comes out, its blocks stay until release (or abort)
    while the other sequences decode on; both ways free every block."""
    eng = engine(tiny, max_num_batched_tokens=16)  # the held prompt's prefill is chunked into decode steps
    running = eng.add_request(prompts()[0], GREEDY)
    eng.step()
    held = eng.add_request(prompts()[1], GREEDY, hold=True)
    firsts = []
    while eng.has_work():
        firsts += [o for o in eng.step() if o.request_id == held.request_id]
    assert [o.token_id for o in firsts] == reference[1][:1] and firsts[0].finish_reason is None
    assert running.output_token_ids == reference[0] and eng.seqs[held.request_id] is held
    assert len(held.block_table) == 5 and held.num_computed_tokens == 40  # its KV kept for the hand-off
    eng.release(held.request_id)
    assert eng.blocks.free_blocks == eng.blocks.num_blocks and not eng.seqs and not eng.holding
    aborted = eng.add_request(prompts()[3], GREEDY, hold=True)
    while eng.has_work():
        eng.step()
    assert eng.abort(aborted.request_id) and eng.blocks.free_blocks == eng.blocks.num_blocks and not eng.holding


def test_stop_conditions(tiny, reference):
    eng = engine(tiny)
    p = prompts()[0]
    ref = reference[0]
    c = eng.generate([p], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[5]]))[0]
    assert c.token_ids == ref[: ref.index(ref[5]) + 1] and c.finish_reason == FinishReason.STOP
    c = eng.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert c.token_ids == ref[:3] and c.finish_reason == FinishReason.LENGTH
    # The model's context (128) ends a request with "length" even when max_tokens is larger.
    c = eng.generate([p * 20], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(c.token_ids) == 128 - 100 and c.finish_reason == FinishReason.LENGTH
    assert eng.blocks.free_blocks == eng.blocks.num_blocks


def test_seeded_sampling_independent_of_batch(tiny):
    eng = engine(tiny)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = eng.generate([prompts()[3]], p)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = eng.generate([prompts()[0], prompts()[3], prompts()[5]], [other, p, other])[1].token_ids
    assert alone == mixed


def test_bad_requests_are_typed_and_queue_nothing(tiny):
    eng = engine(tiny)
    with pytest.raises(PromptTooLongError, match="context is 128"):
        eng.add_request(list(range(3, 131)), GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.add_request([1, 99999], GREEDY)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0)):
        with pytest.raises(InvalidSamplingParams):
            eng.add_request([5, 6], SamplingParams(**bad))
    assert not eng.has_work() and eng.blocks.free_blocks == eng.blocks.num_blocks


def test_a_context_the_pool_cannot_hold_is_known_at_start(tiny):
    """A pool of 4 blocks of 8 holds one 32-token sequence: the model's context (128) is lowered to
    32 at start (and a longer prompt refused as over the context); an explicit --max-model-len of
    64 is a clear error at start naming the flags, not a refusal at the first long request."""
    eng = engine(tiny, num_blocks=4)
    assert eng.max_model_len == 32
    with pytest.raises(PromptTooLongError, match="context is 32"):
        eng.add_request(list(range(3, 60)), GREEDY)
    assert engine(tiny, num_blocks=16, max_model_len=100).max_model_len == 100  # 128 tokens: it fits
    with pytest.raises(InvalidRequestError, match=r"max_model_len 64 does not fit the KV pool.*--kv-cache-mb.*--max-model-len to 32"):
        engine(tiny, num_blocks=4, max_model_len=64)


def test_a_step_on_a_share_of_the_cores_is_logged_apart_with_its_threads(tiny):
    """A worker on a core share hands it to its engine: a step run while the share says it runs on
    fewer threads because busy workers of its role share the cores (role_share) goes to
    shared_step_log with that thread count, the others to step_log (the coordinator fits its
    all-core model on those alone and learns what sharing costs from these)."""
    import types

    from pdserve.runtime.engine import drain_steps

    eng = engine(tiny)
    few = dict(temperature=0, max_tokens=3, ignore_eos=True)
    eng.core_share = types.SimpleNamespace(role_share=0)
    eng.generate([prompts()[1]], SamplingParams(**few))
    alone = drain_steps(eng)
    assert alone and all(len(s) == 4 for s in alone) and not drain_steps(eng, shared=True)
    eng.core_share.role_share = 1
    eng.generate([prompts()[1]], SamplingParams(**few))
    shared = drain_steps(eng, shared=True)
    assert not drain_steps(eng) and len(shared) == len(alone)
    assert all(len(s) == 5 and s[4] == 1 and s[3] > 0 for s in shared)
    eng.core_share = None  # no core share: every step is an all-core step
    eng.generate([prompts()[1]], SamplingParams(**few))
    assert len(drain_steps(eng)) == len(alone) and not drain_steps(eng, shared=True)
    assert eng.blocks.free_blocks == eng.blocks.num_blocks
