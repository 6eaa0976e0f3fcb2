"""The scheduler as plain data, without a model: token budget and chunks, admission order,
preemption of the newest sequence, sequences that can never fit; each ends with its blocks freed."""
from pdserve.runtime.kv_cache import BlockManager
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.sequence import SeqStatus, Sequence
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason


def seq(rid, n, max_tokens=4):
    return Sequence(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def test_scheduler_budget_chunks_and_admission_order():
    # a and b share a prefix (range(n)): with the prefix cache b would wait for a's blocks
    s = Scheduler(BlockManager(100, 4, prefix_cache=False), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq("a", 7), seq("b", 6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 7), ("b", 3)]
    a.num_computed_tokens, b.num_computed_tokens = 7, 3
    a.output_token_ids.append(1)
    out = s.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 1), ("b", 3)]


def test_scheduler_preempts_newest_and_drops_unfittable():
    bm = BlockManager(3, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = seq("old", 4), seq("new", 4)
    s.add(old)
    s.add(new)
    s.schedule()
    for x in (old, new):
        x.num_computed_tokens = 4
        x.output_token_ids.append(9)
    out = s.schedule()  # old needs a 2nd block (1 free), then new needs one: none left -> new preempted
    assert [x.request_id for x in out.preempted] == ["new"]
    assert new.status == SeqStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    s.finish(old, FinishReason.STOP)
    s.finish(new, FinishReason.ABORT)
    assert bm.free_blocks == 3
    huge = seq("huge", 20)
    s.add(huge)
    out = s.schedule()
    assert out.finished == [huge] and huge.finish_reason == FinishReason.LENGTH and bm.free_blocks == 3


def test_waiting_queue_respects_priority_then_arrival():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [Sequence(name, [1, 2], SamplingParams(), priority=p) for name, p in (("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2))]
    for x in seqs:
        s.add(x)
    assert [x.request_id for x in s.waiting] == ["e", "b", "d", "a", "c"]
