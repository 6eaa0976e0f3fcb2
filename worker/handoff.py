"""Prefill hand-offs: what a worker does with a `Prefill` message, shared by the prefill worker
and the worker that can take every role (worker/any_role.py).

Lifecycle: `Handoffs.accept(msg)` checks the peer's Prefill (its grant fits its tokens:
dest_block_ids, one per block of prompt + output, dest_cached_blocks below that; the engine
refuses bad token ids or params) and queues its prompt in the worker's engine held
(`add_request(..., hold=True)`: the prompt is computed, its first token sampled, and its blocks
kept), remembered as a `Job`; a Prefill refused fails at once, before any compute. After each
step the worker gives the step's outputs to `take`: a job's output is handed off (its blocks,
all but the first dest_cached_blocks the decode worker's prefix cache holds, go to the decode
worker by the backend the sender picked from that worker's pool description; KVReady follows)
and then released, which frees its blocks here; the other outputs are returned to the worker.
For a model whose every layer slides the decode side grants NULL_BLOCK for the positions
wholly before the window of the first position it decodes (decode/grants.py), so only the
window's blocks travel (`blocks_to_send`); this side freed the same ones after the prefill. A
model with KV groups (sliding layers beside full ones: runtime.kv_groups) is granted every
group's table, interleaved position by position (BlockManager.interleave), NULL before each
sliding group's own window: its sequence's tables are interleaved alike, so the full group's
blocks all travel and each sliding group's only within its window.
`abort(rid)` drops a job not yet handed off and tells the decode side. Every path frees the
job's blocks: a hand-off that fails tells the decode side (KVFailed, it frees the grant) and the
coordinator (WorkerError), a finished one tells the coordinator PrefillDone naming the grant
(kv_bytes: every byte of the hand-off, streamed ones too; kv_seconds: what its KVReady's send
took after the last step).

Streamed hand-off (`stream=True`, the default; `--no-handoff-stream` turns it off): per chunk.
After every step, each job whose chunked prefill went on sends the blocks its computed tokens
fill completely and not yet sent (`finished_blocks`) as a KVPart on the same backend (shm and
cuda_ipc write them into the granted blocks, tcp sends them as frames, nccl as sends), so that
after the last chunk only that chunk's blocks (the rest) go with the KVReady, which names how
many were streamed. A block's KV never changes once its tokens are computed, so a part is final;
a job preempted here and recomputed streams nothing it sent already (the same tokens' KV). The
decode side starts only on the KVReady; a part that fails to send fails the job as a failed
hand-off does. Per layer (sending each layer's blocks as the forward writes them) is not built:
it needs a hook in the model's forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import zmq

from pdserve.runtime.engine import LLMEngine, StepOutput
from pdserve.runtime.kv_cache import NULL_BLOCK
from pdserve.wire import liveness
from pdserve.wire.protocol import KVPart, KVReady, Prefill, PrefillDone, WorkerError
from pdserve_client.errors import PdserveError


@dataclass
class Job:
    msg: Prefill
    t_start: float
    streamed: int = 0  # the hand-off's blocks (blocks_to_send's pairs, in order) sent ahead in KVParts
    streamed_bytes: int = 0


def finished_blocks(table: list[int], dest_ids: list[int], skip: int, computed: int, block_size: int,
                    groups: int = 1) -> list[tuple[int, int]]:
    """(source, destination) pairs of the blocks a prompt's `computed` tokens fill completely, from
    position skip on, whose destination entry is a block (blocks_to_send's pairs, as far as they
    are final): never the grant's last position, which the KVReady carries. With KV groups table
    and dest_ids hold `groups` entries a position (BlockManager.interleave). ValueError if such a
    source block was freed (a sliding window frees here only what the grant leaves NULL)."""
    done = min(computed // block_size, len(dest_ids) // groups - 1, len(table) // groups) * groups
    pairs = []
    for s, d in zip(table[skip * groups:done], dest_ids[skip * groups:done]):
        if d == NULL_BLOCK:
            continue
        if s == NULL_BLOCK:
            raise ValueError("a block the grant wants was freed here (sliding window) before it was sent")
        pairs.append((s, d))
    return pairs


def blocks_to_send(table: list[int], dest_ids: list[int], skip: int) -> tuple[list[int], list[int]]:
    """(source blocks, destination blocks) of a hand-off: each entry from skip on whose
    destination entry is a block (with KV groups: interleaved tables, skip 0). A destination
    NULL_BLOCK marks a position wholly before the decode side's sliding window, which it never
    reads (decode/grants.py); this side freed the same positions after the prefill
    (runtime.kv_cache), so the two must agree. ValueError if the grant does not fit the table or
    its NULL_BLOCK entries are not the blocks freed here."""
    if len(dest_ids) != len(table) or not 0 <= skip < len(table):
        raise ValueError(f"granted {len(dest_ids)} blocks ({skip} cached) for {len(table)} needed")
    if any((s == NULL_BLOCK) != (d == NULL_BLOCK) for s, d in zip(table[skip:], dest_ids[skip:])):
        raise ValueError("the grant's unwanted (NULL) blocks are not those before the sliding window, which were freed here")
    pairs = [(s, d) for s, d in zip(table[skip:], dest_ids[skip:]) if d != NULL_BLOCK]
    return [s for s, _ in pairs], [d for _, d in pairs]


class Handoffs:
    def __init__(self, engine: LLMEngine, pool: torch.Tensor, sender, link, stream: bool = True):
        self.engine = engine
        self.stream = stream  # send each chunk's finished blocks as soon as it is computed (KVPart)
        self.pool = pool  # the engine's KV pool, (layers, 2, num_blocks, block_size, KVH, D): what hand-offs read
        self.sender = sender  # KVSender, or kvtransfer.local.LocalKV
        self.link = link
        self.jobs: dict[str, Job] = {}

    def accept(self, msg: Prefill) -> None:
        """Queue msg's prompt (held after its prefill), or fail it at once if its grant or tokens are wrong."""
        blocks = self.engine.blocks
        need = blocks.blocks_for(len(msg.prompt_token_ids) + len(msg.output_token_ids))
        if len(msg.dest_block_ids) != need * blocks.groups or not 0 <= msg.dest_cached_blocks < need \
                or (blocks.groups > 1 and msg.dest_cached_blocks):
            self.fail(msg, "kv_transfer_failed", f"invalid hand-off: granted {len(msg.dest_block_ids)} blocks "
                                                 f"({msg.dest_cached_blocks} cached) for {need} needed in each of {blocks.groups} KV groups")
            return
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id, msg.output_token_ids, msg.priority, hold=True)
        except PdserveError as e:
            self.fail(msg, e.code, str(e))
            return
        self.jobs[msg.request_id] = Job(msg, time.perf_counter())

    def abort(self, rid: str) -> bool:
        """Drop rid's job if it has one (its blocks freed, the decode side told); whether it had."""
        job = self.jobs.pop(rid, None)
        if job is None:
            return False
        self.engine.abort(rid)
        self.sender.fail(job.msg.dest_kv_endpoint, rid, "aborted", job.msg.grant)
        return True

    def abort_all(self) -> None:
        for rid in list(self.jobs):
            self.abort(rid)

    def oldest(self) -> float:
        """When the longest-waiting job arrived (perf_counter); jobs must not be empty."""
        return min(j.t_start for j in self.jobs.values())

    def take(self, outs: list[StepOutput], compute: float) -> list[StepOutput]:
        """Hand off (or fail) the jobs among a step's outputs, each released after; the others back."""
        if not self.jobs:  # a decode worker's every step: nothing to hand off
            return outs
        rest = []
        for out in outs:
            job = self.jobs.pop(out.request_id, None)
            if job is None:
                rest.append(out)
                continue
            liveness.touch()  # each hand-off may wait up to the sender's timeout (10 s) for a dead decode worker
            if out.error is not None:  # its grammar did not compile (in budget): the engine freed it
                self.fail(job.msg, out.error.code, str(out.error))
            elif out.token_id is None:  # could never fit this worker's pool: the engine freed it
                self.fail(job.msg, "prompt_too_long", "prompt does not fit this worker's KV pool")
            else:
                self.hand_off(job, out, compute)
                self.engine.release(out.request_id)
        if self.stream:
            self.stream_parts()
        return rest

    def stream_parts(self) -> None:
        """Send, for every job still prefilling, the blocks finished since its last part (one KVPart
        each); a job whose part fails is failed and freed, its decode side and the coordinator told."""
        blocks = self.engine.blocks
        for rid, job in list(self.jobs.items()):
            seq = self.engine.seqs.get(rid)
            if seq is None or not seq.num_computed_tokens:
                continue
            msg = job.msg
            try:
                new = finished_blocks(blocks.interleave(seq.block_tables), msg.dest_block_ids, msg.dest_cached_blocks,
                                      seq.num_computed_tokens, blocks.block_size, blocks.groups)[job.streamed:]
                if not new:
                    continue
                liveness.touch()
                part = KVPart(rid, [d for _, d in new], job.streamed, "", msg.grant)
                job.streamed_bytes += self.sender.send(self.pool, [s for s, _ in new], part, msg.dest_kv_endpoint)
            except (OSError, ValueError, RuntimeError, zmq.ZMQError) as e:
                del self.jobs[rid]
                self.engine.abort(rid)
                self.fail(msg, "kv_transfer_failed", f"hand-off failed: {e}")
                continue
            job.streamed += len(new)

    def claim_cores(self, cores) -> None:
        """Before a step with prompts to hand off: the node's prefill turn (runtime.cores) if the
        step computes; with only grammars compiling (on their own thread) the decode workers keep
        the cores."""
        if self.engine.runnable():
            cores.take_prefill_turn()
        else:
            cores.idle()

    def hand_off(self, job: Job, out: StepOutput, compute: float) -> None:
        """Send the KV of the job's prompt (and its first token) to the decode worker, less the blocks
        streamed ahead; report either way."""
        msg = job.msg
        seq = self.engine.seqs[msg.request_id]
        skip = msg.dest_cached_blocks  # the decode worker holds these already
        t0 = time.perf_counter()
        try:
            src, dest = blocks_to_send(self.engine.blocks.interleave(seq.block_tables), msg.dest_block_ids, skip)
            ready = KVReady(
                msg.request_id, seq.prompt_token_ids, list(seq.output_token_ids), msg.params, dest,
                seq.num_computed_tokens, "", out.logprob, out.top_logprobs, msg.priority, msg.grant,  # the sender names its backend
                out.prompt_logprobs, job.streamed,
            )
            nbytes = job.streamed_bytes + self.sender.send(self.pool, src[job.streamed:], ready, msg.dest_kv_endpoint)
        except (OSError, ValueError, RuntimeError, zmq.ZMQError) as e:
            self.sender.fail(msg.dest_kv_endpoint, msg.request_id, f"hand-off failed: {e}", msg.grant)
            self.link.send(WorkerError(msg.request_id, "kv_transfer_failed", str(e)))
            return
        self.link.send(PrefillDone(msg.request_id, seq.num_computed_tokens, nbytes, time.perf_counter() - t0, compute, msg.grant))

    def fail(self, msg: Prefill, code: str, message: str) -> None:
        self.sender.fail(msg.dest_kv_endpoint, msg.request_id, message, msg.grant)
        self.link.send(WorkerError(msg.request_id, code, message))

    def wait_for_batch(self, window: float, handle) -> None:
        """Hold the first prompt up to `window` seconds so later ones share its forward: messages
        that come meanwhile go to handle(msg); ends early once the step's token budget is full or
        no job is left."""
        budget = self.engine.config.max_num_batched_tokens
        deadline = self.oldest() + window
        while time.perf_counter() < deadline and self.engine.queued_tokens() < budget:
            for msg in self.link.drain(max(0.0, deadline - time.perf_counter())):
                handle(msg)
            if not self.jobs:
                return
