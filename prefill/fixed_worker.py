"""The prefill worker (`pdserve prefill`): prompt forward passes, first token, KV hand-off.

Lifecycle: `PrefillWorker.build` loads the model into an engine in prefill mode with a private
KV pool (with `--tensor-parallel-size N`, worker.tp_ranks: N rank processes sharing it in
/dev/shm), times a few prompts, and makes the KV sender and the link that says Hello; the worker
itself is built from those parts (tests pass an in-process transport and link). Then `run`
loops:
  drain the inbox: Prefill -> queue the prompt in the engine, remembering its destination
  (decode worker, granted block ids); Abort -> drop it if not yet handed off, telling the
  decode side; SetRole -> RoleSet: it stays a prefill worker (its engine decodes nothing, its
  pool is private), so any other role is answered with error "not supported: ..." (its Hello
  names no roles to change to: `pdserve worker` is the worker that can);
  batching window: once a prompt waits, wait up to `batch_window_ms` (or until the token
  budget is full) so several prompts pack into one forward;
  step: the engine packs waiting prompts up to the token budget and chunks long ones; a prompt
  whose last chunk ran comes back with its first token and its blocks still held;
  hand off and release (worker/handoff.py, shared with the worker that can take every role):
  its blocks go to the decode worker, KVReady follows, the engine frees them here at once; with
  the streamed hand-off (the default) each step also sends the blocks a long prompt's chunk
  finished, so the last chunk's are all that is left then.
A failed hand-off tells the decode side (KVFailed, it frees the grant) and the coordinator
(WorkerError); a finished one tells the coordinator PrefillDone naming the grant, so that a grant
whose KVReady was lost on the way is freed all the same (coordinator: handoff_timeouts).
Peers are checked (worker/handoff.py): a Prefill whose grant does not fit its tokens or whose
token ids the engine refuses fails at once with WorkerError, before any compute; the sender
refuses block ids outside the destination pool.
"""
from __future__ import annotations

import logging
import time

import torch
import zmq

from pdserve.kvtransfer import host_tier
from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.transfer import KVSender
from pdserve.runtime import structured
from pdserve.runtime.config import EngineConfig, WorkerConfig
from pdserve.runtime.cores import CoreShare, StaticCores
from pdserve.runtime.engine import LLMEngine, drain_steps, prefix_report
from pdserve.wire import liveness, security
from pdserve.wire.link import CoordinatorRestarted
from pdserve.wire.protocol import Abort, Heartbeat, Prefill, Reject, Role, RoleSet, SetRole, Shutdown
from pdserve.worker import process, tp_ranks
from pdserve.worker.handoff import Handoffs

log = logging.getLogger("pdserve.prefill")


class PrefillWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, pool: torch.Tensor, sender, link, batch_window_ms: float = 2.0,
                 ctx: zmq.Context | None = None, cores: CoreShare | StaticCores | None = None, handoff_stream: bool = True):
        self.worker_id = worker_id
        self.cores = cores or StaticCores()  # busy before each step, idle while waiting (runtime.cores)
        self.engine = engine  # in prefill mode
        self.pool = pool  # the engine's KV pool, (layers, 2, num_blocks, block_size, KVH, D): what hand-offs read
        self.sender = sender  # KVSender, or kvtransfer.local.LocalKV
        self.link = link  # WorkerLink, or anything with send, drain, start, stop, bad_messages, dropped
        self.batch_window = batch_window_ms / 1000
        self.ctx = ctx  # owned: destroyed by close()
        self.handoffs = Handoffs(engine, pool, sender, link, handoff_stream)
        self.jobs = self.handoffs.jobs  # request id -> Job: prompts queued and not yet handed off
        self.running = True
        self.closing = []  # what close() ends last: the other tensor-parallel ranks, the pool's file

    @classmethod
    def build(cls, engine_cfg: EngineConfig, wcfg: WorkerConfig) -> PrefillWorker:
        if wcfg.threads:
            torch.set_num_threads(wcfg.threads)
        cores = CoreShare.open(wcfg.core_share)
        cores.size_alone()
        wid = process.worker_id(Role.PREFILL, wcfg)
        structured.configure(model=wcfg.model)  # its tokenizer is loaded on the first structured request

        def make_pool(shape, shared: bool):  # private, but for TP n: its ranks share it
            if shared:
                return KVPool.create(shape, engine_cfg.torch_dtype, shared=True)
            return KVPool(torch.zeros(shape, dtype=engine_cfg.torch_dtype, device=engine_cfg.device))

        model, kv, ranks = tp_ranks.load_model(engine_cfg, wcfg, make_pool)
        pool = tp_ranks.handoff_pool(kv)  # what hand-offs read: on CUDA with TP n, every rank's part
        engine = LLMEngine(model, None, engine_cfg, kv_cache=kv.tensor, prefill_only=True)
        engine.core_share = cores
        with cores.alone():
            profile = engine.profile(batches=(1, 4), prompt_len=128, decode_steps=0, long_prompts=(1, 512))
        tier = host_tier.attach(engine, engine_cfg, wcfg.model)  # --kv-host-tier-mb (None: off), after the profile's random prompts
        ctx = zmq.Context()
        sender = KVSender(ctx, wid, security.worker_options(wcfg.keys), backend=wcfg.kv_backend)
        link = process.connect(ctx, wcfg, process.hello(Role.PREFILL, wid, wcfg, engine, pool, profile))
        worker = cls(wid, engine, pool, sender, link, wcfg.batch_window_ms, ctx, cores, wcfg.handoff_stream)
        worker.closing = ([ranks.close] if ranks is not None else []) + [kv.close] + ([tier.close] if tier is not None else [])
        return worker

    def heartbeat(self) -> Heartbeat:
        sched = self.engine.scheduler
        return Heartbeat(
            self.worker_id, self.engine.blocks.free_blocks, len(sched.running), len(sched.waiting), self.engine.queued_tokens(),
            kv_bytes_sent=self.sender.bytes_sent, kv_seconds_sent=self.sender.seconds, bad_messages=self.link.bad_messages,
            steps=drain_steps(self.engine), shared_steps=drain_steps(self.engine, shared=True),
            inbox_dropped=self.link.dropped, **prefix_report(self.engine),
        )

    def run(self) -> None:
        self.link.start(self.heartbeat)
        try:
            while self.running:
                liveness.touch()  # the launcher's hang check (wire/liveness.py)
                self.turn(0 if self.jobs else 0.05)
        finally:
            self.close()

    def turn(self, timeout: float) -> None:
        """One pass of the loop: messages (waiting up to timeout for the first), then, with
        prompts queued, the batching window, a step and its hand-offs."""
        if not self.jobs:
            self.cores.idle()
        msgs = self.link.drain(timeout)
        process.adopt_prefix_secret(self.link, self.engine.blocks)  # before them: they came after the Welcome it names
        for msg in msgs:
            self.handle(msg)
        if self.jobs:
            self.wait_for_batch()
            self.handoffs.claim_cores(self.cores)
            self.step()

    def close(self) -> None:
        self.cores.close()
        self.link.stop()
        self.sender.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        for end in self.closing:
            end()

    def handle(self, msg) -> None:
        if isinstance(msg, Prefill):
            self.handoffs.accept(msg)
        elif isinstance(msg, Abort):
            self.handoffs.abort(msg.request_id)
        elif isinstance(msg, SetRole):
            self.on_set_role(msg)
        elif isinstance(msg, CoordinatorRestarted):
            self.handoffs.abort_all()
        elif isinstance(msg, (Shutdown, Reject)):
            self.running = False

    def on_set_role(self, msg: SetRole) -> None:
        """This worker's engine and pool are built for prefill only (Hello.roles is empty): it stays a prefill worker."""
        error = "" if msg.role == Role.PREFILL else f"not supported: a dedicated prefill worker cannot take the {msg.role.name.lower()} role"
        self.link.send(RoleSet(self.worker_id, Role.PREFILL, msg.change, error))

    def wait_for_batch(self) -> None:
        """Hold the first prompt up to the batching window so later ones share its forward."""
        self.handoffs.wait_for_batch(self.batch_window, self.handle)

    def step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.handoffs.take(outs, time.perf_counter() - t0)  # every output is a job's (or one that is gone: dropped)


def serve(engine_cfg: EngineConfig, worker_cfg: WorkerConfig) -> None:
    process.serve(process.build_or_exit(lambda: PrefillWorker.build(engine_cfg, worker_cfg)))
