"""The decode worker built from parts, in one process: a tiny model's engine, the in-process
KV transport (kvtransfer.local) and a fake link in place of the coordinator; a real prefill
worker (prefill mode) hands it prompts.

Disaggregated in one process gives the single-process engine's tokens; admissions, aborts,
failed hand-offs and expired grants each end with every block free.
"""

from pdserve.kvtransfer.local import LocalKV
from pdserve.prefill.fixed_worker import PrefillWorker
from pdserve.wire.protocol import Abort, Admit, AdmitRefused, Granted, KVFailed, Prefill, Release, TokenBatch, WorkerError
from pdserve.worker.any_role import Worker
from pdserve_client.params import SamplingParams
from tests.helpers import FakeLink, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
DEST = "local://decode-1"


def workers(tiny, kv_cache_dtype: str = "auto", **config):
    """(prefill worker, decode worker, the decode side's inbox); config: the decode engine's, kv_cache_dtype both's."""
    kv = LocalKV()
    d_engine, d_pool = tiny_engine(tiny, kv_cache_dtype=kv_cache_dtype, **config)
    d = Worker("decode-1", d_engine, kv, FakeLink())
    inbox = kv.register(DEST, d_pool)
    p_engine, p_pool = tiny_engine(tiny, prefill_only=True, kv_cache_dtype=kv_cache_dtype)
    return PrefillWorker("prefill-1", p_engine, p_pool, kv, FakeLink()), d, inbox


def admit(d: Worker, rid: str, tokens: int) -> list[int]:
    d.link.inbox.append(Admit(rid, tokens, 1))
    d.turn(0)
    granted = [m for m in d.link.taken(Granted) if m.request_id == rid]
    return granted[-1].block_ids


def deliver(d: Worker, inbox: list) -> None:
    d.link.inbox += inbox
    inbox.clear()


def tokens_of(d: Worker) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for batch in d.link.taken(TokenBatch):
        for item in batch.items:
            if item.token_id >= 0:
                out.setdefault(item.request_id, []).append(item.token_id)
    return out


def all_free(w) -> bool:
    return w.engine.blocks.free_blocks == w.engine.blocks.num_blocks and not w.engine.seqs


def test_handed_off_prompts_decode_to_the_single_process_tokens(tiny):
    p, d, inbox = workers(tiny)
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 45)), "c": list(range(100, 141))}
    for rid, prompt in prompts.items():
        p.link.inbox.append(Prefill(rid, prompt, GREEDY, "decode-1", DEST, admit(d, rid, len(prompt))))
    while p.jobs or p.link.inbox:
        p.turn(0)
    deliver(d, inbox)
    while d.link.inbox or d.engine.has_work():
        d.turn(0)
    reference, _ = tiny_engine(tiny)
    want = {rid: c.token_ids for rid, c in zip(prompts, reference.generate(list(prompts.values()), GREEDY))}
    assert tokens_of(d) == want
    ends = [i.finish_reason for b in d.link.taken(TokenBatch) for i in b.items if i.finish_reason is not None]
    assert len(ends) == 3 and all(r.name == "LENGTH" for r in ends)
    assert all_free(p) and all_free(d) and not d.grants


def test_an_admission_the_pool_cannot_hold_is_refused(tiny):
    _, d, _ = workers(tiny, num_blocks=4)
    d.link.inbox.append(Admit("big", 40, 1))
    d.turn(0)
    assert [m.request_id for m in d.link.taken(AdmitRefused)] == ["big"] and all_free(d)


def test_a_failed_hand_off_frees_the_grant_and_is_reported(tiny):
    _, d, inbox = workers(tiny)
    admit(d, "a", 20)
    inbox.append((KVFailed("a", "hand-off failed: boom"), []))
    deliver(d, inbox)
    d.turn(0)
    assert [(e.request_id, e.code) for e in d.link.taken(WorkerError)] == [("a", "kv_transfer_failed")]
    assert not d.grants and all_free(d)


def test_an_abort_before_the_kv_arrives_frees_the_grant_when_the_prefill_side_answers(tiny):
    p, d, inbox = workers(tiny)
    blocks = admit(d, "a", 20)
    p.link.inbox.append(Prefill("a", list(range(3, 23)), GREEDY, "decode-1", DEST, blocks))
    d.link.inbox.append(Abort("a"))
    d.turn(0)
    assert d.grants["a"].cancelled and d.engine.blocks.free_blocks < d.engine.blocks.num_blocks  # the prefill side may be writing
    p.turn(0)  # its KVReady arrives for a cancelled grant
    deliver(d, inbox)
    d.turn(0)
    assert not d.grants and not tokens_of(d) and all_free(d) and all_free(p)


def test_release_and_grant_expiry_free_blocks(tiny):
    _, d, _ = workers(tiny)
    admit(d, "released", 20)
    d.link.inbox.append(Release("released"))
    d.turn(0)
    assert all_free(d) and not d.grants
    admit(d, "expired", 20)
    d.grants["expired"].deadline = 0.0  # its KV never came
    d.turn(0)
    assert [e.code for e in d.link.taken(WorkerError)] == ["kv_transfer_timeout"] and all_free(d) and not d.grants


def test_an_abort_mid_stream_ends_the_request_and_frees_its_blocks(tiny):
    p, d, inbox = workers(tiny)
    p.link.inbox.append(Prefill("a", list(range(3, 23)), GREEDY, "decode-1", DEST, admit(d, "a", 20)))
    p.turn(0)
    deliver(d, inbox)
    d.turn(0)
    d.link.inbox.append(Abort("a"))
    d.turn(0)
    last = d.link.taken(TokenBatch)[-1].items[-1]
    assert last.request_id == "a" and last.finish_reason.name == "ABORT" and all_free(d)


# ------------------------------------------------------------------ fenced writes

def sleeper():
    """A live process on this machine to stand for a prefill writer (a real pid whose death we control)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def admit_from(d: Worker, rid: str, tokens: int, writer_pid: int) -> Granted:
    from pdserve.kvtransfer.pool import host_identity

    host, boot = host_identity()
    d.link.inbox.append(Admit(rid, tokens, 1, writer_pid, host, boot))
    d.turn(0)
    return [m for m in d.link.taken(Granted) if m.request_id == rid][-1]


def test_a_released_grant_stays_fenced_until_its_writer_answers(tiny):
    writer = sleeper()
    try:
        p, d, inbox = workers(tiny)
        g = admit_from(d, "a", 20, writer.pid)
        assert g.grant >= 1
        d.link.inbox.append(Release("a", g.grant))  # the coordinator lost the writer (silent): it may still write
        d.turn(0)
        assert not d.grants and d.heartbeat().fenced_blocks == len(g.block_ids)
        assert d.engine.blocks.free_blocks == d.engine.blocks.num_blocks - len(g.block_ids)  # not reusable meanwhile
        # the writer wakes up and writes its stale hand-off: it lands in the fenced blocks and only frees them
        p.link.inbox.append(Prefill("a", list(range(3, 23)), GREEDY, "decode-1", DEST, g.block_ids, grant=g.grant))
        while p.jobs or p.link.inbox:
            p.turn(0)
        deliver(d, inbox)
        d.turn(0)
        assert not d.fences and not tokens_of(d) and all_free(d) and all_free(p)
    finally:
        writer.kill()
        writer.wait()


def test_fenced_blocks_are_freed_when_the_writer_dies(tiny):
    import time

    writer = sleeper()
    _, d, _ = workers(tiny)
    g = admit_from(d, "a", 20, writer.pid)
    d.grants["a"].deadline = d.grants["a"].last_resort = 0.0  # its KV never came: expired for good while the writer lives
    d.turn(0)
    assert [e.code for e in d.link.taken(WorkerError)] == ["kv_transfer_timeout"] and g.grant in d.fences
    d.turn(0)
    assert g.grant in d.fences  # alive: still fenced
    writer.kill()
    writer.wait()
    deadline = time.monotonic() + 5
    while d.fences:
        assert time.monotonic() < deadline, "fence not lifted after the writer died"
        d.turn(0.05)
    assert all_free(d)


def test_a_grant_whose_local_writer_lives_waits_past_its_timeout(tiny):
    """A prompt queued behind a long burst at a live prefill worker is not lost: its grant waits
    (up to LIVE_WRITER_GRANT_FACTOR timeouts), and its KV is taken when it comes."""
    writer = sleeper()
    try:
        _, d, _ = workers(tiny)
        admit_from(d, "a", 20, writer.pid)
        d.grants["a"].deadline = 0.0  # the ordinary timeout passed
        d.turn(0)
        assert "a" in d.grants and not d.link.taken(WorkerError) and not d.fences
        assert d.grants["a"].deadline > 0.0  # looked at again a timeout later
        d.link.inbox.append(Abort("a"))
        d.turn(0)
        d.grants["a"].deadline = d.grants["a"].last_resort = 0.0
        d.turn(0)
        assert "a" not in d.grants
    finally:
        writer.kill()
        writer.wait()


def test_a_grant_no_prefill_was_sent_for_is_freed_at_once_even_if_fenced(tiny):
    writer = sleeper()
    try:
        _, d, _ = workers(tiny)
        g = admit_from(d, "a", 20, writer.pid)
        d.link.inbox.append(Release("a", g.grant, prefill_sent=False))  # the coordinator never sent its Prefill
        d.turn(0)
        assert not d.fences and all_free(d)
        g1 = admit_from(d, "b", 20, writer.pid)
        g2 = admit_from(d, "b", 20, writer.pid)  # a newer admission replaces (fences) the first
        assert g1.grant in d.fences and d.grants["b"].number == g2.grant
        d.link.inbox.append(Release("b", g1.grant, prefill_sent=False))  # the first never had a Prefill either
        d.turn(0)
        assert not d.fences and d.grants["b"].number == g2.grant  # the newer grant is untouched
        # a stale hand-off naming the old grant cannot fill the new one
        d.link.inbox.append((KVFailed("b", "late", g1.grant), []))
        d.turn(0)
        assert "b" in d.grants and not d.link.taken(WorkerError)
        d.link.inbox.append(Release("b", g2.grant, prefill_sent=False))
        d.turn(0)
        assert all_free(d)
    finally:
        writer.kill()
        writer.wait()
