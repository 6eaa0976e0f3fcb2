"""The worker that can take every role (`pdserve worker --role ROLE`; `pdserve decode` starts it
as a decode or colocated worker): decode, colocated (the whole engine in one worker), and prefill
with KV hand-offs to other decode workers; it changes role without a restart (SetRole).

Lifecycle: `Worker.build` loads the model (with `--tensor-parallel-size N`, worker.tp_ranks:
N rank processes sharing the pool), puts the KV pool in shared memory (on a GPU:
one CUDA allocation that prefill workers map over CUDA IPC; its size from the memory budget,
logged at start), binds the kv socket, makes a KV sender (its own hand-offs, with the prefill
worker's security options) and the link that says Hello (its role, and every role as those it
can take); the worker itself is built from those parts (tests pass an in-process transport and
link). Then `run` loops:
  drain the inbox (first keying its prefix cache with the secret of the coordinator's Welcome):
  Admit -> reserve blocks (Granted | AdmitRefused): the prefix-cached blocks of the Admit's prefix
  tokens first, each confirmed against its tokens (Granted.cached_blocks: the prefill side sends only the rest),
  new ones for the rest; KVPart (a streamed hand-off, before its KVReady) -> the grant's next blocks:
  tcp frames copied in (nccl: received), counted in Grant.streamed, nothing started; KVReady -> copy
  tcp frames into the rest of the granted blocks, join the running batch, emit the prefill's first token at once;
  Generate (colocated, or the coordinator's local path) -> queue for chunked prefill here;
  Prefill -> queue the prompt held after its prefill (worker/handoff.py: checked as the prefill
  worker checks it), handed off to its decode worker after the step that computes it and then
  released; Abort / Release -> free (a Prefill's destination told);
  SetRole -> take the role (RoleSet answers with the role it now has; the Hello its link says
  on a reconnect names it). Every kind of message is taken whatever the role (the coordinator
  stops sending work of the old kind before a change); the role decides how the worker shares
  the node's cores and what its heartbeat reports. In the prefill role with prompts to hand
  off it runs as the prefill worker does: a batching window, then `take_prefill_turn` before
  the step, its queued prompt tokens as its load. Otherwise:
  step the engine (continuous batching: joiners enter at the next step, finished sequences
  leave at once, a short pool preempts the newest sequence, which is recomputed here), unless a
  prefill worker of this node is busy: then it holds its step until that worker yields it a turn
  between two prefill steps, or until its stall cap (runtime.cores: the TPOT target the
  coordinator's Welcome names sets both);
  send the step's tokens as one TokenBatch; expire grants whose KV never came.
Every block is freed on every path: finish, abort, release, failed hand-off (either way), grant timeout.
Fenced writes: each grant has a number (Granted -> Prefill -> KVReady/KVFailed), and a hand-off
fills only the grant it names. A grant given up before its writer answered (Release, expiry, a
newer admission) whose writer may write into this pool directly (Admit names it: a prefill
process on this machine, shm) is not freed but fenced: its blocks stay out of the free list
until the writer's KVReady/KVFailed for that grant arrives or its process is gone, so a stalled
writer (SIGSTOP, a long pause) that wakes up can never land in blocks another request owns.
A writer whose answer was lost is done all the same once it reported PrefillDone: the
coordinator then sends Release(prefill_sent=False), which frees the grant or its fence at once.
Peers are checked: a KVReady whose blocks are not its grant's, whose num_computed is not the
granted token count (prompt + output - 1), or whose token ids, params, top logprobs or prompt
scores (one per prompt token after the first, when asked) are out of range, or whose count of
streamed blocks is not the KVParts' that arrived, fails that request (WorkerError
kv_transfer_failed, counted in bad_messages; decode/grants.py holds the checks) and frees its
grant before anything reaches a copy or the engine; a KVPart that is not its grant's next blocks
(or fails the receiver's checks: BadPart) fails the request likewise, its grant given up as on
Release (fenced while a writer on this machine lives: later parts of a writer that goes on
streaming land only there); a KVPart for a grant given up, cancelled or unknown is dropped (its
writer's KVReady/KVFailed settles the grant). A Generate is validated by the engine.
The shared pool is a file of this user's 0700 pool directory with a random name
(kvtransfer/pool_files.py); on exit it is unlinked, and one a SIGKILL left is removed by the next
worker or launch to start on this machine.
"""
from __future__ import annotations

import logging
import time

import torch
import zmq

from pdserve.decode.grants import FENCE_CHECK_S, LIVE_WRITER_GRANT_FACTOR, Fence, Grant, grant_blocks, handoff_problem, part_problem
from pdserve.kvtransfer import host_tier
from pdserve.kvtransfer.cuda_ipc import CudaKVPool, gpu_pool
from pdserve.kvtransfer.errors import InvalidHandoff, KVTransferError
from pdserve.kvtransfer.pool import KVPool, host_identity, process_alive
from pdserve.kvtransfer.transfer import BadPart, KVReceiver, KVSender
from pdserve.runtime import cuda_graphs, structured
from pdserve.runtime.config import EngineConfig, WorkerConfig
from pdserve.runtime.cores import CoreShare, StaticCores, stall_cap
from pdserve.runtime.engine import LLMEngine, StepOutput, drain_steps, prefix_report
from pdserve.runtime.kv_cache import NULL_BLOCK
from pdserve.wire import liveness, security
from pdserve.wire.link import CoordinatorRestarted
from pdserve.wire.protocol import (
    Abort,
    Admit,
    AdmitRefused,
    Generate,
    Granted,
    Heartbeat,
    KVFailed,
    KVPart,
    KVReady,
    Prefill,
    PromptLogprobs,
    Reject,
    Release,
    Role,
    RoleSet,
    SetRole,
    Shutdown,
    TokenBatch,
    TokenOut,
    WorkerError,
)
from pdserve.worker import process, tp_ranks
from pdserve.worker.handoff import Handoffs
from pdserve_client.errors import PdserveError
from pdserve_client.protocol import FinishReason

log = logging.getLogger("pdserve.decode")


def token_out(o: StepOutput) -> TokenOut:
    return TokenOut(o.request_id, -1 if o.token_id is None else o.token_id, o.logprob, o.top_logprobs, o.finish_reason)


ALL_ROLES = [Role.PREFILL, Role.DECODE, Role.COLOCATED]


class Worker:
    def __init__(self, worker_id: str, engine: LLMEngine, receiver, link, grant_timeout_s: float = 30.0,
                 closing: list | None = None, cores: CoreShare | StaticCores | None = None, sender=None,
                 role: Role = Role.DECODE, batch_window_ms: float = 2.0, kv_pool=None, handoff_stream: bool = True):
        self.worker_id = worker_id
        self.role = Role(role)  # how it shares the node's cores and what it reports; it takes every kind of work whatever its role
        # the roles SetRole may give it: every one with a KV sender (Prefill hand-offs), else only its own
        self.roles = list(ALL_ROLES) if sender is not None else []
        self.sender = sender  # KVSender, or kvtransfer.local.LocalKV: Prefill hand-offs from this worker's pool
        # kv_pool: what hand-offs read (worker.tp_ranks.handoff_pool; None: the engine's pool)
        self.handoffs = (Handoffs(engine, engine.runner.kv_cache if kv_pool is None else kv_pool, sender, link, handoff_stream)
                         if sender is not None else None)
        self.batch_window = batch_window_ms / 1000  # the prefill role's batching window (as the prefill worker's)
        self.cores = cores or StaticCores()  # busy before each step, idle while waiting (runtime.cores)
        self.engine = engine
        self.receiver = receiver  # KVReceiver, or kvtransfer.local.LocalKV
        self.link = link  # WorkerLink, or anything with send, drain, start, stop, bad_messages, dropped
        self.grant_timeout_s = grant_timeout_s
        self.closing = closing or []  # what close() ends after the link and receiver: authenticator, context, pool
        self.grants: dict[str, Grant] = {}
        self.fences: dict[int, Fence] = {}  # grant number -> its fenced blocks
        self.grants_made = 0
        self.machine = host_identity()  # a writer with the same (host, boot id) can write into the pool directly
        self.next_fence_check = 0.0
        self.running = True
        self.deferring = False  # holding steps while a prefill worker of this node is busy
        self.last_step_end = 0.0

    @classmethod
    def build(cls, engine_cfg: EngineConfig, wcfg: WorkerConfig, role: Role = Role.DECODE) -> Worker:
        if wcfg.threads:
            torch.set_num_threads(wcfg.threads)
        cores = CoreShare.open(wcfg.core_share)
        cores.size_alone()
        wid = process.worker_id(role, wcfg)
        structured.configure(model=wcfg.model)  # its tokenizer is loaded on the first structured request

        def make_pool(shape, shared: bool):
            if engine_cfg.device.startswith("cuda"):  # on the GPU, exported over CUDA IPC when cupy is here
                return gpu_pool(shape, engine_cfg.torch_dtype, engine_cfg.device)
            return KVPool.create(shape, engine_cfg.kv_torch_dtype, shared=shared or wcfg.shared_pool)

        model, pool, ranks = tp_ranks.load_model(engine_cfg, wcfg, make_pool)  # TP n: ranks 1..n-1 started, sharing the pool
        num_blocks = pool.tensor.shape[2]
        engine = LLMEngine(model, None, engine_cfg, kv_cache=pool.tensor)
        engine.core_share = cores
        if engine_cfg.device.startswith("cuda") and engine_cfg.cuda_graphs and ranks is None:  # a TP step broadcasts its plan: no graph
            cuda_graphs.enable(engine)
        log.info(
            "%s: KV pool %d blocks x %d tokens = %d tokens (%.1f MiB)%s", wid, num_blocks, engine_cfg.block_size,
            num_blocks * engine_cfg.block_size, pool.nbytes / 2**20, f" in {pool.path}" if pool.path else "",
        )
        with cores.alone():
            profile = engine.profile()
        tier = host_tier.attach(engine, engine_cfg, wcfg.model)  # --kv-host-tier-mb (None: off), after the profile's random prompts
        security.check_bind(wcfg.kv_bind, wcfg.keys, wcfg.insecure)
        ctx = zmq.Context()
        auth = security.start_authenticator(ctx, wcfg.keys)
        kv = tp_ranks.handoff_pool(pool)  # on CUDA with TP n: every rank's part
        receiver = KVReceiver(ctx, kv, wcfg.kv_bind, security.server_options(wcfg.keys, security.WORKERS),
                              ipc=pool.accept() if isinstance(pool, (CudaKVPool, tp_ranks.RankPools)) else None, shm_path=pool.path)
        sender = KVSender(ctx, wid, security.worker_options(wcfg.keys), backend=wcfg.kv_backend)  # as the prefill worker's
        link = process.connect(ctx, wcfg, process.hello(role, wid, wcfg, engine, kv, profile, receiver.endpoint, ALL_ROLES))
        link.watch(receiver.sock, lambda sock: receiver.recv())
        closing = [auth.stop] if auth is not None else []
        closing += [ranks.close] if ranks is not None else []
        closing += [tier.close] if tier is not None else []
        return cls(wid, engine, receiver, link, wcfg.grant_timeout_s, closing + [lambda: ctx.destroy(linger=0), pool.close],
                   cores, sender, role, wcfg.batch_window_ms, kv, wcfg.handoff_stream)

    # ------------------------------------------------------------------ loop

    def heartbeat(self) -> Heartbeat:
        """Its load as its role reports it: in the prefill role, as a prefill worker, the prompt
        tokens not yet computed (compiling, queued or running); else those queued."""
        sched = self.engine.scheduler
        queued = self.engine.queued_tokens() if self.role == Role.PREFILL else sum(s.num_uncomputed for s in list(sched.waiting))
        sent = {"kv_bytes_sent": self.sender.bytes_sent, "kv_seconds_sent": self.sender.seconds} if self.sender is not None else {}
        return Heartbeat(
            self.worker_id, self.engine.blocks.free_blocks, len(sched.running), len(sched.waiting), queued, **sent,
            kv_bytes_received=self.receiver.bytes_received,
            bad_messages=self.receiver.bad_messages + self.link.bad_messages, preemptions=sched.num_preemptions,
            steps=drain_steps(self.engine), shared_steps=drain_steps(self.engine, shared=True),
            inbox_dropped=self.link.dropped, fenced_blocks=self.fenced_blocks,
            **prefix_report(self.engine),
        )

    @property
    def fenced_blocks(self) -> int:
        return sum(len(f.block_ids) for f in list(self.fences.values()))

    def run(self) -> None:
        self.link.start(self.heartbeat)
        try:
            while self.running:
                liveness.touch()  # the launcher's hang check (wire/liveness.py)
                # deferring to a busy local prefill worker: look again in 5 ms (messages wake it sooner)
                self.turn((0.005 if self.deferring else 0) if self.engine.has_work() else 0.05)
        finally:
            self.close()

    def turn(self, timeout: float) -> None:
        """One pass of the loop: messages (waiting up to timeout for the first), a step of the
        engine with its tokens sent, expired grants freed."""
        if not self.engine.runnable():  # idle, or only grammars compiling (on their own thread)
            self.cores.idle()
        msgs = self.link.drain(timeout)
        process.adopt_prefix_secret(self.link, self.engine.blocks)  # before them: they came after the Welcome it names
        for msg in msgs:
            self.handle(msg)
        if self.role == Role.PREFILL and self.handoffs is not None and self.handoffs.jobs:
            self.prefill_turn()
        else:
            self.decode_turn()
        self.expire_grants()

    def prefill_turn(self) -> None:
        """The prefill role with prompts to hand off, as a prefill worker: the batching window,
        then a step on the cores a node's decode workers yield it (runtime.cores)."""
        self.deferring = False
        self.handoffs.wait_for_batch(self.batch_window, self.handle)
        if not self.engine.has_work():  # aborted meanwhile
            return
        self.handoffs.claim_cores(self.cores)
        self.step()

    def decode_turn(self) -> None:
        """The decode and colocated roles (and the prefill role with only other work): a step,
        unless a busy prefill worker of this node holds the cores."""
        welcome = getattr(self.link, "welcome", None)
        cap = stall_cap(welcome.tpot_ms if welcome is not None else 0.0)
        # deferring: the prefill worker of this node takes every core meanwhile (runtime.cores)
        self.deferring = self.engine.runnable() and self.cores.defer_to_prefill(time.monotonic() - self.last_step_end, cap)
        if not self.deferring and self.engine.has_work():
            if self.engine.runnable():
                self.cores.busy()
            self.step()

    def step(self) -> None:
        """An engine step: its Prefill jobs handed off (worker/handoff.py), every other output sent."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        if self.handoffs is not None:
            outs = self.handoffs.take(outs, time.perf_counter() - t0)
        self.emit(outs)
        self.last_step_end = time.monotonic()

    def close(self) -> None:
        self.cores.close()
        self.link.stop()
        self.receiver.close()
        if self.sender is not None:
            self.sender.close()
        for end in self.closing:
            end()

    def emit(self, outs: list[StepOutput]) -> None:
        tokens = []
        for o in outs:
            if o.prompt_logprobs is not None:  # before the batch with its first token, in its own message (wire/protocol.py)
                self.link.send(PromptLogprobs(o.request_id, o.prompt_logprobs))
            if o.error is None:
                tokens.append(token_out(o))
            else:  # failed in the engine (a grammar that did not compile): a typed error, not a finish
                self.link.send(WorkerError(o.request_id, o.error.code, str(o.error)))
        if tokens:
            self.link.send(TokenBatch(tokens))

    # ------------------------------------------------------------------ messages

    def handle(self, msg) -> None:
        if isinstance(msg, tuple) and isinstance(msg[0], (KVPart, BadPart)):  # a streamed hand-off's part
            self.on_kv_part(*msg)
        elif isinstance(msg, tuple):  # (KVReady | KVFailed, frames) from the kv socket
            self.on_kv(*msg)
        elif isinstance(msg, Admit):
            self.on_admit(msg)
        elif isinstance(msg, Generate):
            self.on_generate(msg)
        elif isinstance(msg, Prefill):
            self.on_prefill(msg)
        elif isinstance(msg, SetRole):
            self.on_set_role(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.request_id)
        elif isinstance(msg, Release):
            self.on_release(msg)
        elif isinstance(msg, CoordinatorRestarted):
            self.abort_all()
        elif isinstance(msg, (Shutdown, Reject)):
            self.running = False

    def abort_all(self) -> None:
        """The coordinator that placed our requests is gone: end them all, free every block."""
        log.warning("coordinator restarted: aborting %d requests", len(self.engine.seqs) + len(self.grants))
        if self.handoffs is not None:
            self.handoffs.abort_all()  # their destinations told (KVFailed)
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        for grant in self.grants.values():
            grant.cancelled = True  # freed when the prefill side answers, or at the grant deadline

    def on_admit(self, msg: Admit) -> None:
        self.give_up(msg.request_id)  # a newer admission of the same request replaces the old grant
        blocks = self.engine.blocks
        ids = grant_blocks(self.engine.blocks, msg) if msg.num_tokens > 0 else None
        if ids is None:
            self.link.send(AdmitRefused(msg.request_id, f"kv pool short: {blocks.free_blocks} blocks free", msg.admission))
            return
        ids, cached = ids
        self.grants_made += 1
        writer = msg.writer_pid if (msg.writer_host, msg.writer_boot) == self.machine else 0
        now = time.monotonic()
        self.grants[msg.request_id] = Grant(ids, now + self.grant_timeout_s, self.grants_made, writer, cached=cached,
                                            last_resort=now + LIVE_WRITER_GRANT_FACTOR * self.grant_timeout_s, tokens=msg.num_tokens)
        self.link.send(Granted(msg.request_id, ids, msg.admission, self.grants_made, cached))

    def on_kv(self, msg, frames) -> None:
        fence = self.fences.pop(msg.grant, None) if msg.grant else None
        if fence is not None:  # the writer of a given-up grant is done with its blocks
            log.info("grant %d of %s: its writer answered; %d fenced blocks freed", msg.grant, msg.request_id, len(fence.block_ids))
            self.engine.blocks.free(fence.block_ids)
            return
        grant = self.grants.get(msg.request_id)
        if grant is None or msg.grant not in (0, grant.number):
            return  # for a grant given up and freed, or one this worker never made: nothing of ours
        del self.grants[msg.request_id]
        if grant.cancelled:
            self.engine.blocks.free(grant.block_ids)
            return
        try:
            self.take_kv(msg, grant, frames)
        except KVTransferError as e:  # failed, invalid, or (nccl) its blocks never arrived: the communicator is dropped
            self.engine.blocks.free(grant.block_ids)
            self.link.send(WorkerError(msg.request_id, e.code, str(e)))
            return
        out = self.engine.add_prefilled(
            msg.request_id, msg.prompt_token_ids, msg.output_token_ids, msg.params, grant.block_ids,
            msg.num_computed, msg.logprob, msg.top_logprobs, msg.priority, msg.prompt_logprobs,
        )
        self.emit([out])

    def on_kv_part(self, msg: KVPart | BadPart, frames) -> None:
        """A streamed hand-off's part: the grant's next blocks copied in (tcp, nccl; shm and
        cuda_ipc wrote them already) and counted; one that is wrong fails its request."""
        part = msg.part if isinstance(msg, BadPart) else msg
        grant = self.grants.get(part.request_id)
        if grant is None or part.grant not in (0, grant.number) or grant.cancelled:
            return  # given up, fenced or aborted: its writer's KVReady/KVFailed settles it
        if isinstance(msg, BadPart):
            problem = msg.reason  # counted by the receiver
        elif (problem := part_problem(msg, grant, NULL_BLOCK)) is not None:
            self.receiver.bad_messages += 1
        else:
            try:
                self.receiver.copy_in(msg, frames)
            except KVTransferError as e:
                problem = str(e)
        if problem is not None:
            self.give_up(part.request_id)  # fenced while its writer on this machine lives: it may go on streaming
            self.link.send(WorkerError(part.request_id, "kv_transfer_failed", problem))
            return
        grant.streamed += len(msg.block_ids)

    def take_kv(self, msg: KVReady | KVFailed, grant: Grant, frames) -> None:
        """Take the answer to a live grant: its blocks copied in if it is a valid KVReady, else
        KVTransferError (a KVFailed, a copy that failed, or InvalidHandoff: counted)."""
        if isinstance(msg, KVFailed):
            raise KVTransferError(msg.reason)
        problem = handoff_problem(msg, grant, self.engine)
        if problem is not None:
            self.receiver.bad_messages += 1
            raise InvalidHandoff(f"invalid hand-off: {problem}")
        self.receiver.copy_in(msg, frames)

    def on_generate(self, msg: Generate) -> None:
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id, msg.output_token_ids, msg.priority)
        except PdserveError as e:
            self.link.send(WorkerError(msg.request_id, e.code, str(e)))

    def on_prefill(self, msg: Prefill) -> None:
        if self.handoffs is None:
            self.link.send(WorkerError(msg.request_id, "kv_transfer_failed", "not supported: this worker has no KV sender"))
            return
        self.handoffs.accept(msg)

    def on_set_role(self, msg: SetRole) -> None:
        """Take msg.role (the coordinator drained work of the old kind first; what is left is
        served all the same) and say so: RoleSet with the role it now has, or its old one and an
        error if it cannot take that one. The Hello the link says on a reconnect names it."""
        role = Role(msg.role)
        if role != self.role and role not in self.roles:
            self.link.send(RoleSet(self.worker_id, self.role, msg.change, f"not supported: this worker cannot take the "
                                                                          f"{role.name.lower()} role"))
            return
        if role != self.role:
            log.info("%s: role %s -> %s (change %d)", self.worker_id, self.role.name.lower(), role.name.lower(), msg.change)
            self.role = role
            self.cores.idle()  # a prefill role's flag left set would hold the node's decode workers back
            process.announce_role(self.link, role)
        self.link.send(RoleSet(self.worker_id, self.role, msg.change))

    def on_abort(self, rid: str) -> None:
        if self.handoffs is not None:
            self.handoffs.abort(rid)  # a prompt it was to hand off: the decode side told, no tokens to report
        if rid in self.grants:
            self.grants[rid].cancelled = True  # the prefill side may still be writing into it
        elif self.engine.abort(rid):
            self.emit([StepOutput(rid, None, finish_reason=FinishReason.ABORT)])

    def on_release(self, msg: Release) -> None:
        if not msg.prefill_sent and msg.grant in self.fences:  # fenced meanwhile, but it never had a writer
            self.engine.blocks.free(self.fences.pop(msg.grant).block_ids)
            return
        grant = self.grants.get(msg.request_id)
        if grant is not None and msg.grant in (0, grant.number):
            self.give_up(msg.request_id, msg.prefill_sent)

    def give_up(self, rid: str, prefill_sent: bool = True) -> None:
        """Stop waiting for rid's grant: free its blocks, or fence them while a writer that may
        write into them directly is alive (a Prefill was sent and the writer is on this machine)."""
        grant = self.grants.pop(rid, None)
        if grant is None:
            return
        if prefill_sent and grant.writer and process_alive(grant.writer):
            # prefix-cache blocks are never written by the hand-off, nor a sliding window's NULL entries: not fenced
            written = [b for b in grant.block_ids[grant.cached:] if b != NULL_BLOCK]
            log.warning("grant %d of %s given up before prefill pid %d answered: %d blocks fenced until it does or exits",
                        grant.number, rid, grant.writer, len(written))
            self.engine.blocks.free(grant.block_ids[:grant.cached])
            self.fences[grant.number] = Fence(written, grant.writer)
        else:
            self.engine.blocks.free(grant.block_ids)

    def expire_grants(self) -> None:
        now = time.monotonic()
        if self.fences and now >= self.next_fence_check:
            self.next_fence_check = now + FENCE_CHECK_S
            for number in [n for n, f in self.fences.items() if not process_alive(f.writer)]:
                fence = self.fences.pop(number)
                log.warning("prefill pid %d is gone: %d fenced blocks of grant %d freed", fence.writer, len(fence.block_ids), number)
                self.engine.blocks.free(fence.block_ids)
        for rid in [r for r, g in self.grants.items() if g.deadline < now]:
            grant = self.grants[rid]
            if grant.writer and now < grant.last_resort and not grant.cancelled and process_alive(grant.writer):
                # its writer on this machine lives: the prompt is still queued behind others at a busy
                # prefill worker (a 64-request burst queues > 30 s), not lost; a stalled or dead writer is
                # the coordinator's to detect (heartbeats -> Release). Look again a timeout later.
                grant.deadline = now + self.grant_timeout_s
                continue
            log.warning("grant for %s expired without KV", rid)
            if not self.grants[rid].cancelled:
                self.link.send(WorkerError(rid, "kv_transfer_timeout", "prefill hand-off never arrived"))
            self.give_up(rid)


def serve(engine_cfg: EngineConfig, worker_cfg: WorkerConfig, role: Role = Role.DECODE) -> None:
    process.serve(process.build_or_exit(lambda: Worker.build(engine_cfg, worker_cfg, role)))
