"""Which way a request is served: prefill on a prefill worker then hand-off (REMOTE), or prefill
on the decode worker itself, chunked into its decode steps as a colocated worker does (LOCAL).
Plain functions over plain data, no sockets and no clock.

Lifecycle: for each request to place, the server takes the snapshots it takes for placement
(coordinator/placement.py: each decode snapshot names the prompt tokens that worker is expected
to hold) and calls `choose_path`. Both ways are predicted with placement's own functions: REMOTE
is `place_pair` (TTFT = waited + prefill backlog and prompt + relay + one decode step; TPOT = a
decode step with one more sequence); LOCAL is `place_colocated` over the decode workers with KV
room, with this prompt counted in each worker's prefill share, so the TPOT predicted is that of
the worker's own streams stretched by the prompt it would take in. The returned `PathChoice`
carries the decision to apply (PLACED: `prefill` set -> Admit, else -> Generate to the decode
worker; WAIT; SHED), both ways' decisions and the reason (for the trace, stats and metrics).

Sharing a node (`share_node`, before the choice): a decode worker on the cores of a busy prefill
worker defers its steps to it (runtime/cores.py), so a LOCAL prompt's first token waits a turn per
step while that worker has work; a prefill worker yields its node's decode workers a turn, so a
REMOTE prefill stretches by their steps; a hand-off costs what was measured into that decode
worker (HandoffTimes, coordinator/calibration.py). Each way is held to its own admission targets
(`local_targets`: the calibration per path).

With targets (SLO control), a way must meet them (the targets given are already less the
admission headroom); of two that do, LOCAL when its decode worker shares its node's cores with the
prefill workers (the prompt takes the same cores either way: a 1 + 1 node then serves as one
colocated worker with every core, and the prefill worker takes what LOCAL cannot take at all:
what LOCAL refuses for its targets there, REMOTE refuses too, `local_refusal_binds`), else the one
with the most headroom = min over TTFT and TPOT of (target - predicted) / target, REMOTE only by a
margin (`PathRule.remote_margin`). Without targets, Dynamo's conditional disaggregation: LOCAL when
the prompt's uncached tokens are few (`PathRule.local_tokens`) or the prefill queue is long
relative to the decode worker's own (more than `PathRule.queue_prompts` such prompts ahead of it),
else REMOTE.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.common.core_turns import turn_after
from pdserve.coordinator.placement import (
    ADMIT_WINDOW_S,
    WAIT,
    Decision,
    Outcome,
    RequestView,
    SharedCores,
    ShedReason,
    WorkerSnapshot,
    decode_blocks,
    full_batch,
    place_colocated,
    place_pair,
    shed,
)
from pdserve.coordinator.slo import SloTargets, StretchedModel


class Path(enum.Enum):
    REMOTE = "remote"  # prefill worker, then hand-off to the decode worker
    LOCAL = "local"  # the decode worker prefills it in its own steps


@dataclass(frozen=True)
class PathRule:
    """Without SLO control. Dynamo's router sends a prefill remote when its uncached length is
    over 1000 tokens (GPUs) and fewer than 2 requests wait for a prefill worker. On this CPU
    engine a 128-token prompt costs a decode step a few tens of ms and colocated serving beat the
    1 + 1 split at 128-token prompts (issue 23's table), so the default keeps up to 512 local."""

    local_tokens: int = 512  # uncached prompt tokens at or under this: prefilled on the decode worker
    queue_prompts: int = 2  # the prefill queue is long when it is this many such prompts behind the decode worker's
    # With SLO control and the workers on different nodes, REMOTE must beat LOCAL's headroom by this
    # much: the predictions err by ~15% (docs/operations.md, "Latency targets"), and a hand-off moves KV over the network.
    remote_margin: float = 0.05


@dataclass(frozen=True)
class PathChoice:
    decision: Decision  # what the server applies
    path: Path | None  # None: neither way placed it (decision is WAIT or SHED)
    reason: str  # a short code, counted: headroom, only_remote, only_local, short_prompt, long_queue, long_prompt, ...
    detail: str = ""  # the numbers that decided it, for the log and the trace
    remote: Decision | None = None  # each way's own answer; None: that way has no workers
    local: Decision | None = None

    def attributes(self) -> dict:
        """Flat, for a trace span and the stats: the way taken, why, both ways' predictions in ms."""
        out = {"path": self.path.value if self.path else "none", "path_reason": self.reason}
        for name, d in (("remote", self.remote), ("local", self.local)):
            if d is not None and d.predicted_ttft is not None:
                out[f"{name}_ttft_ms"] = round(d.predicted_ttft * 1000, 1)
                out[f"{name}_tpot_ms"] = round(d.predicted_tpot * 1000, 1)
        return out


def headroom(d: Decision, targets: SloTargets) -> float | None:
    """min((target - predicted) / target) over TTFT and TPOT of a placed, predicted decision."""
    if d.outcome is not Outcome.PLACED or d.predicted_ttft is None:
        return None
    return min((targets.ttft_s - d.predicted_ttft) / targets.ttft_s, (targets.tpot_s - d.predicted_tpot) / targets.tpot_s)


def uncached(req: RequestView, w: WorkerSnapshot) -> int:
    return max(0, req.num_tokens - w.cached_tokens)


def local_stall_ok(req: RequestView, d: WorkerSnapshot, targets: SloTargets) -> bool:
    """Whether d's running streams keep their TPOT target through the step that takes in req's
    uncached prompt: that step is one long gap for each of them, which its TPOT (an average over
    its output) carries as stall / (output tokens - 1); the shortest output placed on d is the
    stream it hurts most. The averaged share in place_colocated misses this when a stream is
    short and the prompt long (tests/slo/test_overload.py: p99 TPOT 51-60 ms at a 38-42 ms target)."""
    if not d.requests or not d.shortest_output:
        return True
    stall = d.model.predict(d.requests + 1, d.requests + uncached(req, d), d.context_tokens + req.num_tokens)
    step = d.model.predict(d.requests, d.requests, d.context_tokens)
    return step + stall / max(1, d.shortest_output - 1) <= targets.tpot_s


def local_candidates(req: RequestView, decodes: list[WorkerSnapshot], targets: SloTargets | None = None) -> list[WorkerSnapshot]:
    """Decode workers with KV room for req (with targets: with a free place in their batch, and
    whose streams keep their TPOT through the prompt's step, local_stall_ok), each with req's
    uncached tokens added to its recent prompt tokens: its streams' predicted steps stretch by the
    prompt it would take in. A prompt on a worker whose batch is full waits for a stream to end,
    which no prediction here covers (tests/slo/test_overload.py: LOCAL TTFT 6-14x its prediction)."""
    fits = [d for d in decodes if d.free_blocks >= decode_blocks(d, req.num_tokens)
            and (targets is None or (not full_batch(d) and local_stall_ok(req, d, targets)))]
    return [dataclasses.replace(d, recent_prompt_tokens=d.recent_prompt_tokens + uncached(req, d)) for d in fits]


def share_node(prefills: list[WorkerSnapshot], decodes: list[WorkerSnapshot], node: Mapping[str, str],
               stall_cap_s: float) -> tuple[list[WorkerSnapshot], list[WorkerSnapshot]]:
    """The snapshots with what sharing a node's cores costs (runtime/cores.py; `node`: worker id ->
    its node; workers missing from it share with no one), as `SharedCores`: each decode worker
    defers its steps to its node's prefill workers while they have work, one step a turn (every
    turn_after(cap) plus the prefill step in progress, never over the cap); each prefill worker
    yields its node's decode workers with work a turn (their step) every turn_after(cap)."""
    turn = turn_after(stall_cap_s)

    def mates(w: WorkerSnapshot, others: list[WorkerSnapshot]) -> list[WorkerSnapshot]:
        return [o for o in others if w.worker_id in node and node.get(o.worker_id) == node[w.worker_id]]

    def prefill_step(p: WorkerSnapshot) -> float:
        n = max(1, min(p.queued_tokens, p.chunk_tokens))
        return p.model.predict(1, n, n)

    out_d = []
    for d in decodes:
        busy = [p for p in mates(d, prefills) if p.queued_tokens]
        work = sum(p.queued_tokens / p.model.tokens_per_second() for p in busy)
        gap = min(stall_cap_s, turn + max(map(prefill_step, busy), default=0.0))
        share = sum(p.recent_prompt_tokens / p.model.tokens_per_second() for p in mates(d, prefills)) / ADMIT_WINDOW_S
        out_d.append(dataclasses.replace(d, shared=SharedCores(work, gap, share, stall_cap_s)) if mates(d, prefills) else d)
    out_p = []
    for p in prefills:
        steps = [d.model.predict(d.requests, d.requests + min(d.queued_tokens, d.chunk_tokens), d.context_tokens)
                 for d in mates(p, decodes) if d.requests or d.queued_tokens]
        out_p.append(dataclasses.replace(p, shared=SharedCores(sum(steps), turn)) if mates(p, decodes) else p)
    return out_p, out_d


def share_role_cores(snaps: list[WorkerSnapshot], node: Mapping[str, str], cores: Mapping[str, int],
                     factor: Callable[[str, int, int], float]) -> list[WorkerSnapshot]:
    """The snapshots of one role's workers with what sharing a node's cores among themselves costs:
    on a core share each busy worker runs on cores // (busy workers) threads (runtime/cores.py),
    so a worker given work while k others of its node are busy steps on cores // (k + 1) threads,
    its steps `factor(worker id, cores, threads)` times its all-core model's (StretchedModel).
    Workers of the other role are `share_node`'s: a decode worker defers to a busy prefill worker
    rather than sharing the cores with it. `node`: worker id -> its core share; `cores`: worker id
    -> its threads alone (0 or missing: not shared)."""
    def has_work(s: WorkerSnapshot) -> bool:
        return bool(s.requests or s.queued_tokens)

    busy = collections.Counter(node[s.worker_id] for s in snaps if s.worker_id in node and has_work(s))
    out = []
    for s in snaps:
        group, alone = node.get(s.worker_id), cores.get(s.worker_id, 0)
        sharing = busy[group] + (0 if has_work(s) else 1) if group is not None else 1
        threads = max(1, alone // max(1, sharing))
        k = factor(s.worker_id, alone, threads) if alone > 1 and threads < alone else 1.0
        out.append(dataclasses.replace(s, model=StretchedModel(s.model, k)) if k > 1.0 else s)
    return out


def local_refusal_binds(remote: Decision, gentle: list[WorkerSnapshot]) -> bool:
    """Whether LOCAL's refusal of a prompt for its targets binds REMOTE too: where REMOTE's decode
    worker shares its node's cores with the prefill workers and LOCAL could take the prompt (a place
    in its batch, streams that bear the stall), the prompt takes the same cores either way, so what
    LOCAL's prediction refuses, a hand-off only makes later (measured with `--paths auto` on a 1 + 1
    node: REMOTE took what LOCAL refused, its TTFT came out at up to 2.1x its prediction and the node
    served 0.78-0.89x the goodput of `--colocated`)."""
    d = next((w for w in gentle if w.worker_id == remote.worker), None)
    return d is not None and d.shared is not None


def pick(ok: dict, local: Decision | None, decodes: list[WorkerSnapshot], rule: PathRule) -> tuple[Path, str]:
    """Of two ways that both meet the targets, the one to take and why: LOCAL when its decode
    worker shares its node's cores with the prefill workers (a prompt takes the same cores either
    way, and LOCAL spares the hand-off and the turns: the launch then serves as a colocated worker
    with every core, and the prefill worker takes what LOCAL cannot), else REMOTE only by
    `rule.remote_margin`."""
    remote_ahead = ok[Path.REMOTE] > ok[Path.LOCAL] + rule.remote_margin
    d = next((w for w in decodes if local is not None and w.worker_id == local.worker), None)
    if d is not None and d.shared is not None:
        return Path.LOCAL, "shared_node" if remote_ahead else "headroom"
    return (Path.REMOTE if remote_ahead else Path.LOCAL), "headroom"


def choose_path(req: RequestView, prefills: list[WorkerSnapshot], decodes: list[WorkerSnapshot],
                targets: SloTargets | None, rule: PathRule = PathRule(), local_targets: SloTargets | None = None) -> PathChoice:
    """The way to serve req (see the module docstring). `decodes` are the workers that take
    hand-offs and local prefills; `prefills` may be empty (then only LOCAL). `local_targets`:
    LOCAL's own admission targets where its predictions err apart from REMOTE's (calibration per path)."""
    locals_ = local_candidates(req, decodes)
    if targets is None:
        return by_rule(req, prefills, decodes, locals_, rule)
    local_targets = local_targets or targets
    unparked = dataclasses.replace(req, parked=False)
    remote = place_pair(unparked, prefills, decodes, targets) if prefills and decodes else None
    gentle = local_candidates(req, decodes, local_targets)
    local = place_colocated(unparked, gentle, local_targets) if gentle else None
    if locals_ and not gentle:
        local = shed(ShedReason.TPOT, "no decode worker has a place in its batch whose streams keep their TPOT target through a local prefill")
    room = {p: headroom(d, t) for p, d, t in ((Path.REMOTE, remote, targets), (Path.LOCAL, local, local_targets)) if d is not None}
    ok = {p: h for p, h in room.items() if h is not None}
    if Path.REMOTE in ok and Path.LOCAL not in ok and local_refusal_binds(remote, gentle):
        del ok[Path.REMOTE]
    if ok:
        if len(ok) == 2:
            path, reason = pick(ok, local, gentle, rule)
        else:
            path = next(iter(ok))
            reason = f"only_{path.value}"
        detail = ", ".join(f"{p.value} headroom {h:.2f}" for p, h in ok.items())
        return PathChoice(remote if path is Path.REMOTE else local, path, reason, detail, remote, local)
    if req.parked:  # admitted before: never shed, takes the first room (place_pair's WAIT, or a local worker's queue)
        late = place_pair(req, prefills, decodes, targets) if prefills and decodes else WAIT
        if late.outcome is Outcome.PLACED:
            return PathChoice(late, Path.REMOTE, "parked", "", remote, local)
        if locals_:
            return PathChoice(place_colocated(req, locals_, targets), Path.LOCAL, "parked", "", remote, local)
        return PathChoice(WAIT, None, "parked", "no decode worker has KV room", remote, local)
    # the first way's refusal (REMOTE placed but bound by LOCAL's: LOCAL's), else no pair and no decode room
    miss = next((d for d in (remote, local) if d is not None and d.outcome is not Outcome.PLACED), None) \
        or shed(ShedReason.NO_KV_ROOM, "decode full: no KV room")
    return PathChoice(miss, None, "neither", miss.detail, remote, local)


def by_rule(req: RequestView, prefills: list[WorkerSnapshot], decodes: list[WorkerSnapshot],
            locals_: list[WorkerSnapshot], rule: PathRule) -> PathChoice:
    """Without SLO control: Dynamo's conditional disaggregation on the workers placement picks."""
    remote = place_pair(req, prefills, decodes, None) if prefills and decodes else None
    local = place_colocated(req, locals_, None) if locals_ else None
    if local is None:  # no decode worker has room: the pair waits for it as well
        return PathChoice(WAIT, None, "no_kv_room", "", remote, local)
    if remote is None:
        return PathChoice(local, Path.LOCAL, "only_local", "no prefill worker", remote, local)
    d = next(w for w in locals_ if w.worker_id == local.worker)
    n = uncached(req, d)
    if n <= rule.local_tokens:
        return PathChoice(local, Path.LOCAL, "short_prompt", f"{n} uncached tokens <= {rule.local_tokens}", remote, local)
    p = next(w for w in prefills if w.worker_id == remote.prefill)
    ahead = p.queued_tokens - d.queued_tokens
    if ahead > rule.queue_prompts * n:
        return PathChoice(local, Path.LOCAL, "long_queue",
                          f"prefill queue {p.queued_tokens} tokens, decode worker's {d.queued_tokens}; prompt {n}", remote, local)
    return PathChoice(remote, Path.REMOTE, "long_prompt", f"{n} uncached tokens > {rule.local_tokens}", remote, local)
