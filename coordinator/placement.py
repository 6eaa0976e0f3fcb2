"""Where a request goes: plain functions over plain data, no sockets and no clock.

Lifecycle: for each request to place, the server takes a `WorkerSnapshot` of every live worker
(its step model, free blocks, prompt backlog, the requests placed on it), describes the request
(`RequestView`: tokens, output budget, time waited, whether it was admitted before) and its
targets less the headroom (None: SLO control is off), and calls `place_pair` (prefill + decode
workers registered) or `place_colocated`. Each returns a `Decision`: PLACED on named workers
with the predicted TTFT and TPOT, WAIT for decode room, or SHED with a `ShedReason` and the numbers that
decided it. The server applies it: Admit (pair), Generate (colocated), park, or shed.

KV-aware (prefix cache): each snapshot carries `cached_tokens`, how many of this request's
leading tokens the worker is expected to hold (the server's approximate view of its cached
block keys). A prefill (or colocated) worker costs its backlog plus the tokens it would still
compute; a decode worker, when any holds part of the prompt, the blocks it would still receive
plus the blocks its streams hold (Dynamo's KV router weighs overlap against load the same way),
so a shared system prompt does not pull every stream onto one worker.

Room for a hand-off (`handoff_need`): a model whose every layer slides is granted no blocks before
its window (`kv_window`); one whose sliding layers sit beside full ones (`kv_group_windows`,
runtime.kv_groups) one table per KV group, a sliding group's from its own window on, and a prompt
it computes itself holds every group's table at once (`computed_blocks`).

The predictions (docs/operations.md, "Latency targets"): TTFT = waited + the prefill worker's backlog and
this prompt's uncached tokens at its measured rate + relay + one decode step and the hand-off's
measured cost beyond it (`handoff_s`); TPOT = a decode step with one more sequence, stretched on a
node shared with prefill workers by the share of its time their prompts took lately. A colocated
worker runs prompts in the streams' steps, so its TPOT is stretched by the share of its time
prompts placed on it lately took, plus the backlog spread over this request's output tokens.
Workers of two roles sharing a node's cores (`SharedCores`, filled by coordinator/paths.py
share_node) pay for it: a decode worker's own prompt waits a turn a step while the node's prefill
workers have work (`deferral`), a prefill worker's backlog stretches by the decode turns it yields
(`predict_remote_prefill`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.kv_window import first_needed_block
from pdserve.coordinator.slo import RELAY_OVERHEAD_S, SloTargets, StepModel

ADMIT_WINDOW_S = 10.0  # colocated: the window of placed prompt tokens behind `prefill_share`
MAX_SHARE = 0.9  # a colocated worker's prompts never take more than this share of its time in the TPOT prediction


@dataclass(frozen=True)
class WorkerSnapshot:
    worker_id: str
    model: StepModel  # step seconds ~ a + b*seqs + c*tokens + d*context, fitted on its own steps
    free_blocks: int = 0  # decode and colocated: KV blocks free, less those reserved by admissions in flight
    block_size: int = 16
    queued_tokens: int = 0  # prefill and colocated: prompt tokens placed and not yet through their first step
    requests: int = 0  # requests placed on it
    context_tokens: int = 0  # their tokens (prompt + output so far): the decode step's context
    recent_prompt_tokens: int = 0  # prompt tokens placed on it in the last ADMIT_WINDOW_S (colocated, LOCAL, prefill)
    cached_tokens: int = 0  # of the request being placed: leading tokens it is expected to hold (prefix cache)
    shortest_output: int = 0  # the smallest max_tokens of the requests placed on it (0: none or unknown)
    # on a node whose workers of the other role share its cores (runtime/cores.py): what they take
    shared: SharedCores | None = None
    handoff_s: float = 0.0  # decode: a REMOTE hand-off into it costs this beyond one predicted step (measured: HandoffTimes)
    chunk_tokens: int = 2048  # prompt tokens one of its steps takes at most (max_num_batched_tokens)
    max_seqs: int = 0  # sequences one of its steps runs at most (max_num_seqs; 0: unknown)
    kv_window: int = 0  # every layer's sliding window (runtime.kv_cache): a hand-off's grant leaves the blocks before it out
    # a model with KV groups (sliding layers beside full ones, runtime.kv_groups): each group's window (0: full),
    # a sequence holding one table per group; () for one group
    kv_group_windows: tuple[int, ...] = ()


@dataclass(frozen=True)
class SharedCores:
    """What the workers of the other role on a worker's node take of its cores (runtime/cores.py).
    A decode worker: the node's prefill workers have `work_s` of predicted work, and meanwhile it
    runs a step only in a turn, one every `turn_s` (asked for after turn_after(stall cap), given
    when the prefill step in progress ends). A prefill worker: the node's decode workers take a
    turn of `work_s` (their steps) after each `turn_s` of its work, or after its step if longer."""

    work_s: float = 0.0
    turn_s: float = 0.0
    # a decode worker: the share of the node's time its prefill workers' prompts took lately (the
    # prompt tokens placed on them over the last ADMIT_WINDOW_S at their measured rate): its steps
    # wait for those prefills, so its streams' TPOT stretches by 1 / (1 - share), as a colocated
    # worker's does for its own prompts (`prefill_share`), but by no more than `stall_s` a step:
    # past its stall cap a decode worker steps whatever the prefill worker does (common/core_turns.py)
    prefill_share: float = 0.0
    stall_s: float = 0.0


def deferral(w: WorkerSnapshot, steps: int) -> float:
    """How much later a decode worker's next `steps` steps end because it defers to its node's
    busy prefill workers: each waits a turn while they have work, never more than all of it."""
    if w.shared is None or w.shared.work_s <= 0:
        return 0.0
    return min(w.shared.work_s, steps * w.shared.turn_s)


def local_steps(w: WorkerSnapshot, tokens: int) -> int:
    """The steps until a prompt of `tokens` placed on w has its first token: its backlog and
    this prompt's uncached tokens in chunks of w.chunk_tokens (a step with decode tokens too)."""
    return 1 + (w.queued_tokens + max(0, tokens - w.cached_tokens)) // max(1, w.chunk_tokens)


@dataclass(frozen=True)
class RequestView:
    num_tokens: int  # prompt + tokens already generated (recomputed after a retry)
    max_tokens: int = 16
    waited_s: float = 0.0  # since it arrived at the coordinator
    parked: bool = False  # admitted before (a retry or a wait for room): never shed, takes the first room


class Outcome(enum.Enum):
    PLACED = "placed"
    WAIT = "wait"
    SHED = "shed"


class ShedReason(enum.Enum):
    TTFT = "ttft"  # the best predicted TTFT misses the target
    TPOT = "tpot"  # every worker with room would miss the TPOT target with one more sequence
    NO_KV_ROOM = "no_kv_room"  # no decode worker has the blocks (SLO control sheds rather than queues)


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    worker: str | None = None  # the decode or colocated worker
    prefill: str | None = None  # the prefill worker of a pair
    predicted_ttft: float | None = None  # seconds; None without SLO control
    reason: ShedReason | None = None
    detail: str = ""  # SHED: the numbers, for the client's error and the log
    predicted_tpot: float | None = None  # seconds, with predicted_ttft


WAIT = Decision(Outcome.WAIT)


def placed(worker: str, prefill: str | None = None, ttft: float | None = None, tpot: float | None = None) -> Decision:
    return Decision(Outcome.PLACED, worker, prefill, ttft, predicted_tpot=tpot)


def shed(reason: ShedReason, detail: str) -> Decision:
    return Decision(Outcome.SHED, reason=reason, detail=detail)


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def handoff_need(tokens: int, held: int, block_size: int, window: int, group_windows: tuple[int, ...] = ()) -> int:
    """Blocks a decode worker allocates for a handed-off prompt of `tokens` tokens whose first
    `held` it holds (prefix cache): with a sliding window on every layer, none for the positions
    before the window of its first decoded position (decode/grants.py grants them as -1). With
    KV groups (group_windows; no prefix cache there) each group's table, a sliding group's from
    its own window on."""
    if group_windows:
        return sum(handoff_need(tokens, 0, block_size, w) for w in group_windows)
    skip = max(held, first_needed_block(tokens, window, block_size) * block_size)
    return blocks_needed(tokens - skip, block_size)


def handoff_blocks(d: WorkerSnapshot, tokens: int) -> int:
    """handoff_need on decode worker d (REMOTE: the prompt computed elsewhere; LOCAL computes it
    whole there, decode_blocks)."""
    return handoff_need(tokens, d.cached_tokens, d.block_size, d.kv_window, d.kv_group_windows)


def computed_blocks(tokens: int, block_size: int, group_windows: tuple[int, ...] = ()) -> int:
    """Blocks a worker holds while it computes a prompt of `tokens` (uncached) tokens in one step:
    with KV groups every group's table (a sliding group frees its old blocks only after the step)."""
    return blocks_needed(tokens, block_size) * max(1, len(group_windows))


def predict_prefill(w: WorkerSnapshot, tokens: int) -> float:
    """This prompt's own step (its uncached tokens over the whole context) plus the backlog ahead
    of it at the worker's measured token rate."""
    return w.model.predict(1, max(1, tokens - w.cached_tokens), tokens) + w.queued_tokens / w.model.tokens_per_second()


def predict_remote_prefill(p: WorkerSnapshot, tokens: int) -> float:
    """predict_prefill on a prefill worker, stretched by the turns it yields its node's decode
    workers (its model is fitted on its own steps alone): one turn of theirs after each of its
    steps, or after each turn_s where its steps are shorter."""
    own = predict_prefill(p, tokens)
    if p.shared is None or p.shared.work_s <= 0:
        return own
    n = min(p.queued_tokens + max(1, tokens - p.cached_tokens), p.chunk_tokens)
    return own * (1 + p.shared.work_s / max(p.shared.turn_s, p.model.predict(1, n, n)))


def prefill_cost(w: WorkerSnapshot, tokens: int) -> tuple:
    """Without SLO control: the tokens a prefill (or colocated) worker would compute before this
    prompt's first token, its backlog and this prompt's uncached part; then its request count."""
    return (w.queued_tokens + tokens - w.cached_tokens, w.requests)


def decode_blocks(d: WorkerSnapshot, tokens: int) -> int:
    """Blocks a decode worker must allocate for a prompt: those its prefix cache lacks (a
    prefix its streams share is not free and not needed; a cached one nobody holds is counted
    free and not needed, so room is overestimated by it: the worker refuses, the request waits)."""
    return computed_blocks(tokens - d.cached_tokens, d.block_size, d.kv_group_windows)


def pick_decode(fits: list[WorkerSnapshot], tokens: int) -> WorkerSnapshot:
    """The decode worker with most room, or, when some hold part of the prompt, the one for which
    the blocks it would still receive plus the blocks its streams hold are fewest."""
    if not any(d.cached_tokens for d in fits):
        return most_room(fits)
    return min(fits, key=lambda d: (handoff_blocks(d, tokens) + d.context_tokens / d.block_size, -d.free_blocks))


def predict_step(w: WorkerSnapshot, tokens: int) -> float:
    """A decode step of w with one more sequence of `tokens` tokens."""
    return w.model.predict(w.requests + 1, w.requests + 1, w.context_tokens + tokens) + RELAY_OVERHEAD_S / 3


def full_batch(w: WorkerSnapshot) -> bool:
    """Whether w runs as many sequences as one of its steps takes (max_num_seqs; unknown: never full)."""
    return bool(w.max_seqs) and w.requests >= w.max_seqs


def node_wait(w: WorkerSnapshot, step: float) -> float:
    """What each `step` of decode worker w waits for its node's prefill workers: the stretch
    1 / (1 - their recent share of the node's time), at most their stall bound a step; 0 alone on its cores."""
    if w.shared is None or w.shared.prefill_share <= 0:
        return 0.0
    return min(step / (1 - min(MAX_SHARE, w.shared.prefill_share)) - step, w.shared.stall_s)


def predict_pair_tpot(d: WorkerSnapshot, tokens: int) -> float:
    """The TPOT of a pair's decode worker with one more sequence: its step, stretched by the
    prompts it prefilled itself lately (LOCAL ones, `--paths auto`: its streams wait for them as
    a colocated worker's do; without it a REMOTE admission saw a decode worker full of local
    prompts as free, and took what LOCAL had refused), and what that step waits for the prefill
    workers sharing its node's cores (node_wait; without it, p99 TPOT came out at twice the
    prediction on a 1 + 1 node under overload)."""
    step = predict_step(d, tokens)
    return step / (1 - min(MAX_SHARE, prefill_share(d, tokens))) + node_wait(d, step)


def prefill_share(w: WorkerSnapshot, tokens: int) -> float:
    """Fraction of a colocated worker's time its prompts took lately: the prompt tokens placed on
    it over the last ADMIT_WINDOW_S at the per-token cost of a prompt this long. Streams get the
    rest, so their steps stretch by 1 / (1 - share)."""
    if not w.recent_prompt_tokens:
        return 0.0
    return w.recent_prompt_tokens * w.model.predict(1, tokens, tokens) / tokens / ADMIT_WINDOW_S


def most_room(workers: list[WorkerSnapshot]) -> WorkerSnapshot:
    """The worker with a place in its batch (not full_batch), then the most free blocks, then the fewest requests. A
    full batch comes last: a prompt placed there waits for one of its streams to end while another worker has a place
    (seen under `pdserve launch --ray` without SLO targets: three long requests on one worker of max_num_seqs 2, whose
    heartbeat's free blocks had not yet counted the first two, beside an idle one)."""
    return max(workers, key=lambda w: (not full_batch(w), w.free_blocks, -w.requests))


def place_pair(req: RequestView, prefills: list[WorkerSnapshot], decodes: list[WorkerSnapshot],
               targets: SloTargets | None) -> Decision:
    """A (prefill, decode) pair for req. Without SLO control (targets None) the least loaded
    prefill and the decode worker with most room, or WAIT for room. With it, the prefill worker
    with the lowest predicted TTFT and a decode worker whose predicted TPOT meets the target (an
    idle one always does: its model may be stale from a busy spell), if the TTFT then meets its
    target; else SHED. A parked request skips the TTFT check and waits rather than being shed."""
    fits = [d for d in decodes if d.free_blocks >= handoff_blocks(d, req.num_tokens)]
    if targets is None:
        if not fits:
            return WAIT
        p = min(prefills, key=lambda w: prefill_cost(w, req.num_tokens))
        return placed(pick_decode(fits, req.num_tokens).worker_id, p.worker_id)
    prefill_s = {p.worker_id: predict_remote_prefill(p, req.num_tokens) for p in prefills}
    p = min(prefills, key=lambda w: (prefill_s[w.worker_id], w.queued_tokens, w.requests))
    ttft = req.waited_s + prefill_s[p.worker_id] + RELAY_OVERHEAD_S
    tpot = {d.worker_id: predict_pair_tpot(d, req.num_tokens) for d in fits}
    # a full batch (max_seqs) is not open: the hand-off would wait there for a stream to end, which no
    # prediction covers (as LOCAL's, coordinator/paths.py local_candidates)
    open_ = [d for d in fits if (tpot[d.worker_id] <= targets.tpot_s and not full_batch(d)) or not d.requests]
    if open_:
        d = pick_decode(open_, req.num_tokens)
        ttft += max(0.0, tpot[d.worker_id] + d.handoff_s)  # its first step after the KV lands, as measured (HandoffTimes)
        if ttft <= targets.ttft_s or req.parked:
            return placed(d.worker_id, p.worker_id, ttft, tpot[d.worker_id])
        return shed(ShedReason.TTFT, f"predicted TTFT {ttft * 1000:.0f} ms > target {targets.ttft_s * 1000:.0f} ms")
    if req.parked:
        return WAIT
    # Shed rather than queue: a request that waits for decode room has a TTFT that depends on
    # when others finish, which this model predicts poorly (measured: p99 TTFT 3-5x target).
    if not fits:
        return shed(ShedReason.NO_KV_ROOM, "decode full: no KV room")
    if all(full_batch(d) for d in fits):
        return shed(ShedReason.TPOT, f"decode full: every decode worker with room runs its max_num_seqs ({fits[0].max_seqs}) sequences")
    best = min(predict_pair_tpot(d, req.num_tokens) for d in decodes)
    return shed(ShedReason.TPOT, f"decode full: predicted TPOT {best * 1000:.0f} ms with one more > target {targets.tpot_s * 1000:.0f} ms")


def place_colocated(req: RequestView, workers: list[WorkerSnapshot], targets: SloTargets | None) -> Decision:
    """A colocated worker for req: without SLO control, or for a parked request, the one with
    most room (it queues the prompt itself: there is no WAIT). With it, the lowest predicted
    TTFT among workers meeting both targets, else SHED with the last miss. Measured
    (benchmarks/slo.py): a plain decode step as TPOT gave p99 TPOT 392 ms at a 250 ms target,
    adding the backlog 325 ms, adding the prefill share 204 ms."""
    if targets is None or req.parked:
        if any(w.cached_tokens for w in workers):
            return placed(min(workers, key=lambda w: prefill_cost(w, req.num_tokens)).worker_id)
        return placed(most_room(workers).worker_id)
    best: tuple[WorkerSnapshot, float, float] | None = None
    miss = None
    for w in workers:
        step, prefill = predict_step(w, req.num_tokens), predict_prefill(w, req.num_tokens)
        ttft = req.waited_s + prefill + step + RELAY_OVERHEAD_S + deferral(w, local_steps(w, req.num_tokens))
        busy = min(MAX_SHARE, prefill_share(w, req.num_tokens))
        tpot = step / (1 - busy) + node_wait(w, step) + prefill / max(1, min(req.max_tokens, 4096) - 1)
        if tpot > targets.tpot_s and w.requests:
            miss = shed(ShedReason.TPOT, f"predicted TPOT {tpot * 1000:.0f} ms with one more > target {targets.tpot_s * 1000:.0f} ms "
                                         f"(step {step * 1000:.0f} ms, prompts' share {busy:.2f}, prefill {prefill * 1000:.0f} ms)")
        elif ttft > targets.ttft_s:
            miss = shed(ShedReason.TTFT, f"predicted TTFT {ttft * 1000:.0f} ms > target {targets.ttft_s * 1000:.0f} ms")
        elif best is None or ttft < best[1]:
            best = (w, ttft, tpot)
    return placed(best[0].worker_id, ttft=best[1], tpot=best[2]) if best is not None else miss
