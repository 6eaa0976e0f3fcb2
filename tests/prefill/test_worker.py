"""The prefill worker built from parts, in one process: a tiny model's engine in prefill mode,
the in-process KV transport (kvtransfer.local) and a fake link in place of the coordinator.

Each test drives the worker's loop one `turn` at a time and ends with every block of its pool
free: a hand-off's blocks are released as soon as they are sent, on failure too.
"""
import torch

from pdserve.kvtransfer.local import LocalKV
from pdserve.prefill.fixed_worker import PrefillWorker
from pdserve.wire.protocol import Abort, KVFailed, KVReady, Prefill, PrefillDone, WorkerError
from pdserve_client.params import SamplingParams
from tests.helpers import FakeLink, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DEST = "local://decode-1"


def prefill_worker(tiny, batch_window_ms=0.0, **config):
    engine, pool = tiny_engine(tiny, prefill_only=True, **config)
    return PrefillWorker("prefill-1", engine, pool, LocalKV(), FakeLink(), batch_window_ms)


def job(rid, prompt, blocks):
    return Prefill(rid, prompt, GREEDY, "decode-1", DEST, blocks)


def all_free(p: PrefillWorker) -> bool:
    return p.engine.blocks.free_blocks == p.engine.blocks.num_blocks and not p.engine.seqs


def test_prompts_are_handed_off_with_their_first_token_and_released(tiny):
    p = prefill_worker(tiny)
    dest = torch.zeros_like(p.pool)
    inbox = p.sender.register(DEST, dest)
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 45))}  # 20 tokens: 3 blocks of 8; 5 tokens: 1 block
    p.link.inbox += [job("a", prompts["a"], [10, 11, 12]), job("b", prompts["b"], [20])]
    p.turn(0)
    ready = {m.request_id: m for m, _ in inbox}
    assert set(ready) == {"a", "b"} and all(isinstance(m, KVReady) for m in ready.values())
    reference, _ = tiny_engine(tiny)
    for rid, prompt in prompts.items():
        first = reference.generate([prompt], GREEDY)[0].token_ids[0]
        assert ready[rid].output_token_ids == [first] and ready[rid].num_computed == len(prompt)
    assert [d.request_id for d in p.link.taken(PrefillDone)] == ["a", "b"]
    assert dest[:, :, [10, 11, 12]].abs().sum() > 0 and dest[:, :, 20].abs().sum() > 0  # the KV landed in the granted blocks
    assert all_free(p)


def test_a_prompt_too_long_for_the_pool_fails_and_tells_the_decode_side(tiny):
    p = prefill_worker(tiny, num_blocks=4)  # 32 tokens
    inbox = p.sender.register(DEST, torch.zeros_like(p.pool))
    p.link.inbox.append(job("long", list(range(3, 43)), [0, 1, 2, 3, 4]))
    p.turn(0)
    assert [(e.request_id, e.code) for e in p.link.taken(WorkerError)] == [("long", "prompt_too_long")]
    assert [type(m) for m, _ in inbox] == [KVFailed] and all_free(p)


def test_an_abort_before_the_hand_off_frees_the_prompt_and_tells_the_decode_side(tiny):
    p = prefill_worker(tiny)
    inbox = p.sender.register(DEST, torch.zeros_like(p.pool))
    p.link.inbox += [job("a", list(range(3, 23)), [0, 1, 2]), Abort("a")]
    p.turn(0)
    assert [(type(m), m.reason) for m, _ in inbox] == [(KVFailed, "aborted")]
    assert not p.link.taken(PrefillDone) and not p.jobs and all_free(p)


def test_a_failed_hand_off_is_reported_and_its_blocks_freed(tiny):
    p = prefill_worker(tiny)  # nothing registered at DEST: the transport refuses
    p.link.inbox.append(job("a", list(range(3, 23)), [0, 1, 2]))
    p.turn(0)
    assert [(e.request_id, e.code) for e in p.link.taken(WorkerError)] == [("a", "kv_transfer_failed")]
    assert not p.link.taken(PrefillDone) and all_free(p)


def test_a_grant_of_the_wrong_size_is_a_failed_hand_off(tiny):
    p = prefill_worker(tiny)
    inbox = p.sender.register(DEST, torch.zeros_like(p.pool))
    p.link.inbox.append(job("a", list(range(3, 23)), [0, 1]))  # 20 tokens need 3 blocks
    p.turn(0)
    assert [e.code for e in p.link.taken(WorkerError)] == ["kv_transfer_failed"]
    assert [type(m) for m, _ in inbox] == [KVFailed] and all_free(p)


def test_every_step_reaches_the_heartbeat(tiny):
    """The batching window checks the queued tokens without draining the step log, so each
    step's size and time reach the coordinator's latency model."""
    p = prefill_worker(tiny, batch_window_ms=1000, max_num_batched_tokens=16)  # a full budget ends the window at once
    p.sender.register(DEST, torch.zeros_like(p.pool))
    for i, rid in enumerate(("a", "b")):
        p.link.inbox.append(job(rid, list(range(3 + 20 * i, 19 + 20 * i)), [0, 1]))  # distinct: no prefix-cache hit
        p.turn(0)
    steps = p.heartbeat().steps
    assert [(seqs, tokens) for seqs, tokens, _, _ in steps] == [(1, 16), (1, 16)] and all(s[3] > 0 for s in steps)
    assert p.heartbeat().steps == [] and all_free(p)
