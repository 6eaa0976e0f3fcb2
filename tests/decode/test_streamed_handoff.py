"""The streamed hand-off (worker/handoff.py), both workers built from parts in one process as
tests/decode/test_worker.py builds them: a prompt chunked over several steps sends each chunk's
finished blocks (KVPart) as soon as its step ends, KVReady carries only the last chunk's, and
the decode worker's tokens are the single-process engine's. The slow twin is the hand-off after
the last chunk (`stream=False`): both fill the decode pool with the same bytes. The decode
side's checks on parts (order, blocks, the count KVReady names) fail only that request, fence a
grant whose writer may still write, and every pool ends whole.
"""
import msgspec
import pytest
import torch

from pdserve.kvtransfer.local import LocalKV
from pdserve.prefill.fixed_worker import PrefillWorker
from pdserve.wire.protocol import Abort, KVFailed, KVPart, KVReady, Prefill, PrefillDone, WorkerError
from pdserve.worker.any_role import Worker
from tests.decode.test_worker import DEST, GREEDY, admit, admit_from, all_free, deliver, sleeper, tokens_of
from tests.helpers import FakeLink, tiny_engine

PROMPT = list(range(3, 63))  # 60 tokens: 8 blocks of 8 with the first output token; 4 chunks of 16 tokens
CHUNK = 16


def pair(tiny, stream: bool = True):
    kv = LocalKV()
    d_engine, d_pool = tiny_engine(tiny)
    d = Worker("decode-1", d_engine, kv, FakeLink())
    inbox = kv.register(DEST, d_pool)
    p_engine, p_pool = tiny_engine(tiny, prefill_only=True, max_num_batched_tokens=CHUNK)
    return PrefillWorker("prefill-1", p_engine, p_pool, kv, FakeLink(), 0.0, handoff_stream=stream), d, inbox


def start(p, d, rid="a", prompt=PROMPT) -> list[int]:
    blocks = admit(d, rid, len(prompt))
    p.link.inbox.append(Prefill(rid, prompt, GREEDY, "decode-1", DEST, blocks, grant=d.grants[rid].number))
    return blocks


def run_decode(d) -> None:
    while d.link.inbox or d.engine.has_work():
        d.turn(0)


def test_each_chunk_is_sent_as_its_step_ends_and_only_the_last_goes_with_the_kv_ready(tiny):
    p, d, inbox = pair(tiny)
    blocks = start(p, d)
    dest = p.sender.pools[DEST]
    kinds = []
    for step in range(1, 4):  # three chunks of 16 tokens: two blocks each, sent before the next step
        p.turn(0)
        part = inbox[-1][0]
        assert isinstance(part, KVPart) and (part.first, part.block_ids) == (2 * step - 2, blocks[2 * step - 2:2 * step])
        src = p.engine.seqs["a"].block_table[:2 * step]
        assert torch.equal(dest[:, :, blocks[:2 * step]], p.pool[:, :, src]) and dest[:, :, blocks[:2 * step]].abs().sum() > 0
        assert not p.link.taken(PrefillDone)  # the prompt is not done: these went ahead of it
        kinds.append(type(part))
    p.turn(0)  # the last chunk: the rest (blocks 6 and 7) with the KVReady
    ready = inbox[-1][0]
    assert isinstance(ready, KVReady) and ready.streamed == 6 and ready.block_ids == blocks
    assert [type(m) for m, _ in inbox] == [KVPart] * 3 + [KVReady]
    done = p.link.taken(PrefillDone)[0]
    assert done.kv_bytes == 8 * p.pool[:, :, 0].numel() * 4  # every block, streamed ones too
    deliver(d, inbox)
    run_decode(d)
    reference, _ = tiny_engine(tiny)
    assert tokens_of(d) == {"a": reference.generate([PROMPT], GREEDY)[0].token_ids}
    assert all_free(p) and all_free(d) and not d.grants


def test_the_streamed_and_the_whole_hand_off_fill_the_decode_pool_alike(tiny):
    pools, messages = [], []
    for stream in (True, False):
        p, d, inbox = pair(tiny, stream)
        blocks = start(p, d)
        while p.jobs or p.link.inbox:
            p.turn(0)
        messages.append([(type(m), getattr(m, "streamed", None)) for m, _ in inbox])
        pools.append(p.sender.pools[DEST][:, :, blocks].clone())
        deliver(d, inbox)
        run_decode(d)
        assert all_free(p) and all_free(d)
    assert messages == [[(KVPart, None)] * 3 + [(KVReady, 6)], [(KVReady, 0)]]
    assert torch.equal(pools[0], pools[1]) and pools[0].abs().sum() > 0


def test_a_short_prompt_is_one_kv_ready_as_before(tiny):
    p, d, inbox = pair(tiny)
    start(p, d, "s", list(range(3, 13)))  # one chunk
    p.turn(0)
    assert [(type(m), m.streamed) for m, _ in inbox] == [(KVReady, 0)]


def two_parts_then(p, d, inbox):
    """Run the prefill of PROMPT two chunks in (two KVParts in the inbox)."""
    start(p, d)
    p.turn(0)
    p.turn(0)
    assert [type(m) for m, _ in inbox] == [KVPart, KVPart]


@pytest.mark.parametrize("tamper", [
    lambda parts: [parts[1]],  # the first part lost: the second starts past what arrived
    lambda parts: [parts[0], msgspec.structs.replace(parts[1], block_ids=parts[0].block_ids)],  # blocks already streamed
    lambda parts: [parts[0], msgspec.structs.replace(parts[1], block_ids=[*parts[1].block_ids, 0])],  # beyond the grant
], ids=["out-of-order", "not-the-next-blocks", "not-granted"])
def test_a_wrong_part_fails_only_its_request_and_frees_its_grant(tiny, tamper):
    p, d, inbox = pair(tiny)
    two_parts_then(p, d, inbox)
    inbox[:] = [(m, []) for m in tamper([m for m, _ in inbox])]
    deliver(d, inbox)
    d.turn(0)
    assert [(e.request_id, e.code) for e in d.link.taken(WorkerError)] == [("a", "kv_transfer_failed")]
    assert d.receiver.bad_messages == 1 and not d.grants and all_free(d)
    while p.jobs or p.link.inbox:  # the writer goes on; its later parts and KVReady find no grant
        p.turn(0)
    deliver(d, inbox)
    run_decode(d)
    assert not tokens_of(d) and all_free(d) and all_free(p)


def test_a_kv_ready_that_names_other_than_the_streamed_blocks_that_arrived_fails(tiny):
    p, d, inbox = pair(tiny)
    start(p, d)
    while p.jobs or p.link.inbox:
        p.turn(0)
    ready, _ = inbox.pop()
    inbox.append((msgspec.structs.replace(ready, streamed=ready.streamed - 1), []))  # claims a block more comes with it
    deliver(d, inbox)
    run_decode(d)
    errors = d.link.taken(WorkerError)
    assert [(e.request_id, e.code) for e in errors] == [("a", "kv_transfer_failed")] and "streamed" in errors[0].message
    assert not tokens_of(d) and all_free(d) and all_free(p)


def test_a_wrong_part_from_a_live_writer_on_this_machine_fences_the_grant_until_it_answers(tiny):
    writer = sleeper()
    try:
        p, d, inbox = pair(tiny)
        g = admit_from(d, "a", len(PROMPT), writer.pid)
        p.link.inbox.append(Prefill("a", PROMPT, GREEDY, "decode-1", DEST, g.block_ids, grant=g.grant))
        p.turn(0)
        part, _ = inbox.pop()
        inbox.append((msgspec.structs.replace(part, first=1), []))
        deliver(d, inbox)
        d.turn(0)
        assert [e.code for e in d.link.taken(WorkerError)] == ["kv_transfer_failed"]
        assert g.grant in d.fences and d.heartbeat().fenced_blocks == len(g.block_ids)  # it may go on writing there
        while p.jobs or p.link.inbox:
            p.turn(0)
        deliver(d, inbox)  # its later parts are dropped, its KVReady lifts the fence
        run_decode(d)
        assert not d.fences and not tokens_of(d) and all_free(d) and all_free(p)
    finally:
        writer.kill()
        writer.wait()


def test_an_abort_mid_stream_tells_the_decode_side_which_frees_the_grant(tiny):
    p, d, inbox = pair(tiny)
    two_parts_then(p, d, inbox)
    p.link.inbox.append(Abort("a"))
    p.turn(0)
    assert [type(m) for m, _ in inbox] == [KVPart, KVPart, KVFailed] and not p.jobs and all_free(p)
    deliver(d, inbox)
    d.turn(0)
    assert [e.code for e in d.link.taken(WorkerError)] == ["kv_transfer_failed"] and not d.grants and all_free(d)


def test_parts_for_a_grant_aborted_on_the_decode_side_are_dropped_and_the_grant_freed_at_the_answer(tiny):
    p, d, inbox = pair(tiny)
    two_parts_then(p, d, inbox)
    d.link.inbox.append(Abort("a"))
    d.turn(0)
    deliver(d, inbox)  # parts for a cancelled grant: nothing copied, nothing counted
    d.turn(0)
    assert d.grants["a"].cancelled and d.grants["a"].streamed == 0 and d.receiver.bad_messages == 0
    while p.jobs or p.link.inbox:
        p.turn(0)
    deliver(d, inbox)
    d.turn(0)
    assert not d.grants and not tokens_of(d) and all_free(d) and all_free(p)


def test_a_part_that_cannot_be_sent_fails_the_job_and_frees_it(tiny):
    p, d, inbox = pair(tiny)
    start(p, d)
    del p.sender.pools[DEST]  # the destination is gone before the first part
    p.turn(0)
    assert [(e.request_id, e.code) for e in p.link.taken(WorkerError)] == [("a", "kv_transfer_failed")]
    assert not p.jobs and all_free(p) and [type(m) for m, _ in inbox] == [KVFailed]
    deliver(d, inbox)
    d.turn(0)
    assert not d.grants and all_free(d)
