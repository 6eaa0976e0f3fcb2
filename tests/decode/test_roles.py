"""The worker that can take every role (worker/any_role.py), built from parts in one process: a
tiny model's engines, the in-process KV transport (kvtransfer.local, both its sender and its
receiver) and fake links in place of the coordinator.

In the prefill role it hands prompts off to a decode worker with the single-process engine's
tokens; a Prefill beside running decodes is held, handed off and never reported as tokens;
SetRole changes its role (and how it takes the node's cores) and is answered with RoleSet, after
which it serves the other kind of work; a dedicated prefill worker refuses any other role.
Every path ends with every block of every pool free.
"""
import pytest

from pdserve.kvtransfer.local import LocalKV
from pdserve.prefill.fixed_worker import PrefillWorker
from pdserve.runtime import cores
from pdserve.wire.protocol import (
    Abort,
    Admit,
    Generate,
    Granted,
    KVFailed,
    Prefill,
    PrefillDone,
    Role,
    RoleSet,
    SetRole,
    TokenBatch,
    WorkerError,
)
from pdserve.worker.any_role import Worker
from pdserve_client.params import SamplingParams
from tests.helpers import FakeLink, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {"a": list(range(3, 23)), "b": list(range(40, 45)), "c": list(range(100, 141))}


def worker(tiny, kv: LocalKV, wid: str, role: Role, **config) -> Worker:
    engine, pool = tiny_engine(tiny, **config)
    w = Worker(wid, engine, kv, FakeLink(), sender=kv, role=role, batch_window_ms=0)
    kv.register(endpoint(wid), pool)
    return w


def endpoint(wid: str) -> str:
    return f"local://{wid}"


def pair(tiny, **config) -> tuple[Worker, Worker, LocalKV]:
    """A worker in the prefill role and one in the decode role."""
    kv = LocalKV()
    return worker(tiny, kv, "w-p", Role.PREFILL, **config), worker(tiny, kv, "w-d", Role.DECODE, **config), kv


def prefill_via(p, d: Worker, rid: str, prompt: list[int]) -> None:
    """Admit rid on d, then give its Prefill to p (the coordinator's remote path)."""
    d.link.inbox.append(Admit(rid, len(prompt), 1))
    d.turn(0)
    g = [m for m in d.link.taken(Granted) if m.request_id == rid][-1]
    p.link.inbox.append(Prefill(rid, prompt, GREEDY, d.worker_id, endpoint(d.worker_id), g.block_ids, grant=g.grant))


def run(w: Worker, kv: LocalKV) -> None:
    """Turn w until it has nothing left, taking what was handed to it."""
    while True:
        w.link.inbox += kv.inboxes[endpoint(w.worker_id)]
        kv.inboxes[endpoint(w.worker_id)].clear()
        if not (w.link.inbox or w.engine.has_work()):
            return
        w.turn(0)


def tokens_of(w) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for batch in w.link.taken(TokenBatch):
        for item in batch.items:
            if item.token_id >= 0:
                out.setdefault(item.request_id, []).append(item.token_id)
    return out


def reference(tiny, prompts: dict) -> dict[str, list[int]]:
    engine, _ = tiny_engine(tiny)
    return {rid: c.token_ids for rid, c in zip(prompts, engine.generate(list(prompts.values()), GREEDY))}


def all_free(w) -> bool:
    return (w.engine.blocks.free_blocks == w.engine.blocks.num_blocks and not w.engine.seqs and not w.engine.holding
            and not getattr(w, "grants", None))


def test_the_prefill_role_hands_prompts_off_with_the_single_process_tokens(tiny):
    p, d, kv = pair(tiny)
    for rid, prompt in PROMPTS.items():
        prefill_via(p, d, rid, prompt)
    run(p, kv)
    run(d, kv)
    assert tokens_of(d) == reference(tiny, PROMPTS)
    assert sorted(m.request_id for m in p.link.taken(PrefillDone)) == sorted(PROMPTS)
    assert not p.link.taken(TokenBatch) and not p.link.taken(WorkerError)  # a hand-off is reported as PrefillDone only
    assert p.heartbeat().kv_bytes_sent > 0 and all_free(p) and all_free(d)


def test_a_prefill_beside_running_decodes_is_held_and_handed_off(tiny):
    """In the colocated role with a Generate decoding, a Prefill's prompt is computed in the same
    steps, held, handed off and released; the Generate's tokens are unchanged."""
    kv = LocalKV()
    c = worker(tiny, kv, "w-c", Role.COLOCATED, max_num_batched_tokens=16)  # the prompt is chunked into the decode steps
    d = worker(tiny, kv, "w-d", Role.DECODE)
    c.link.inbox.append(Generate("gen", PROMPTS["b"], GREEDY))
    c.turn(0)
    prefill_via(c, d, "a", PROMPTS["a"])
    run(c, kv)
    run(d, kv)
    want = reference(tiny, {"gen": PROMPTS["b"], "a": PROMPTS["a"]})
    assert tokens_of(c) == {"gen": want["gen"]} and tokens_of(d) == {"a": want["a"]}
    assert [m.request_id for m in c.link.taken(PrefillDone)] == ["a"] and all_free(c) and all_free(d)


def test_failed_and_aborted_hand_offs_free_every_block(tiny):
    p, d, kv = pair(tiny)
    p.link.inbox.append(Prefill("lost", PROMPTS["a"], GREEDY, "gone", "local://gone", [0, 1, 2]))  # no pool there
    p.link.inbox.append(Prefill("short", PROMPTS["a"], GREEDY, d.worker_id, endpoint(d.worker_id), [0, 1]))  # 3 blocks needed
    prefill_via(p, d, "aborted", PROMPTS["c"])
    p.link.inbox.append(Abort("aborted"))
    run(p, kv)
    assert sorted((e.request_id, e.code) for e in p.link.taken(WorkerError)) == [("lost", "kv_transfer_failed"),
                                                                                ("short", "kv_transfer_failed")]
    told = [(m.request_id, type(m)) for m, _ in kv.inboxes[endpoint(d.worker_id)]]
    assert ("aborted", KVFailed) in told and ("short", KVFailed) in told
    assert not p.link.taken(PrefillDone) and not p.link.taken(TokenBatch)
    run(d, kv)  # its grant freed by the KVFailed
    assert all_free(p) and all_free(d)


def test_set_role_switches_prefill_to_decode_and_back(tiny):
    p, d, kv = pair(tiny)
    prefill_via(p, d, "a", PROMPTS["a"])
    p.link.inbox.append(SetRole(Role.DECODE, 7))
    run(p, kv)  # the Prefill queued before the switch is still handed off
    assert p.link.taken(RoleSet) == [RoleSet("w-p", Role.DECODE, 7)] and p.role == Role.DECODE
    assert [m.request_id for m in p.link.taken(PrefillDone)] == ["a"]
    # now a decode worker: Generate (local prefill) and Admit -> KVReady from the other worker, now in the prefill role
    d.link.inbox.append(SetRole(Role.PREFILL, 8))
    d.turn(0)
    assert d.link.taken(RoleSet) == [RoleSet("w-d", Role.PREFILL, 8)]
    p.link.inbox.append(Generate("gen", PROMPTS["c"], GREEDY))
    prefill_via(d, p, "b", PROMPTS["b"])
    run(d, kv)
    run(p, kv)
    run(d, kv)
    want = reference(tiny, PROMPTS)
    assert tokens_of(p) == {"gen": want["c"], "b": want["b"]} and tokens_of(d)["a"] == want["a"]
    # and back: the switched worker takes a Prefill again
    p.link.inbox.append(SetRole(Role.PREFILL, 9))
    d.link.inbox.append(SetRole(Role.DECODE, 10))
    run(p, kv)
    run(d, kv)
    prefill_via(p, d, "c", PROMPTS["c"])
    run(p, kv)
    run(d, kv)
    assert [m.role for m in p.link.taken(RoleSet)] == [Role.DECODE, Role.PREFILL] and tokens_of(d)["c"] == want["c"]
    assert all_free(p) and all_free(d)


def test_the_role_decides_how_the_cores_are_taken_and_the_load_reported(tiny, tmp_path):
    share = cores.CoreShare(cores.create_share(2, str(tmp_path)), 0, 2)
    kv = LocalKV()
    engine, pool = tiny_engine(tiny)
    w = Worker("w", engine, kv, FakeLink(), cores=share, sender=kv, role=Role.PREFILL, batch_window_ms=0)
    kv.register(endpoint("w"), pool)
    d = worker(tiny, kv, "w-d", Role.DECODE)
    prefill_via(w, d, "a", PROMPTS["a"])
    w.link.inbox += [Generate("gen", PROMPTS["b"], GREEDY)]
    w.handle(w.link.inbox.pop(0))  # the Prefill only
    assert w.heartbeat().queued_tokens == len(PROMPTS["a"])  # a prefill worker's load: prompt tokens not yet computed
    w.turn(0)
    assert share.flags[0] == cores.PREFILLING  # took a prefill turn: the node's decode workers defer to it
    w.link.inbox.append(SetRole(Role.DECODE, 1))
    w.turn(0)  # the Generate steps as a decode worker's
    assert share.flags[0] == cores.DECODING and w.role == Role.DECODE
    run(w, kv)
    run(d, kv)
    assert all_free(w) and all_free(d)
    share.close()


def test_a_dedicated_prefill_worker_keeps_its_role(tiny):
    engine, pool = tiny_engine(tiny, prefill_only=True)
    p = PrefillWorker("prefill-1", engine, pool, LocalKV(), FakeLink())
    p.link.inbox += [SetRole(Role.DECODE, 3), SetRole(Role.PREFILL, 4)]
    p.turn(0)
    refused, same = p.link.taken(RoleSet)
    assert (refused.worker_id, refused.role, refused.change) == ("prefill-1", Role.PREFILL, 3)
    assert refused.error.startswith("not supported: ") and same == RoleSet("prefill-1", Role.PREFILL, 4)


@pytest.mark.parametrize("role", [Role.PREFILL, Role.COLOCATED])
def test_a_worker_without_a_sender_refuses_other_roles_and_prefills(tiny, role):
    engine, _ = tiny_engine(tiny)
    w = Worker("w", engine, LocalKV(), FakeLink())
    w.link.inbox += [SetRole(role, 1), Prefill("a", PROMPTS["a"], GREEDY, "d", "local://d", [0, 1, 2])]
    w.turn(0)
    (answer,) = w.link.taken(RoleSet)
    assert answer.role == Role.DECODE and answer.error.startswith("not supported: ") and w.role == Role.DECODE
    assert [e.code for e in w.link.taken(WorkerError)] == ["kv_transfer_failed"] and all_free(w)
