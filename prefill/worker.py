"""The prefill worker (`pdserve prefill`): prompt forward passes, first token, KV hand-off.

Lifecycle: `PrefillWorker.build` loads the model into an engine in prefill mode with a private
KV pool, times a few prompts, and makes the KV sender and the link that says Hello; the worker
itself is built from those parts (tests pass an in-process transport and link). Then `run`
loops:
  drain the inbox: Prefill -> queue the prompt in the engine, remembering its destination
  (decode worker, granted block ids); Abort -> drop it if not yet handed off, telling the
  decode side;
  batching window: once a prompt waits, wait up to `batch_window_ms` (or until the token
  budget is full) so several prompts pack into one forward;
  step: the engine packs waiting prompts up to the token budget and chunks long ones; a prompt
  whose last chunk ran comes back with its first token and its blocks still held;
  hand off: its blocks go to the decode worker (all but the first Prefill.dest_cached_blocks,
  which the decode worker's prefix cache holds already) by the backend the sender picked from that
  worker's pool description (shm: written into its pool; tcp: frames; GPU: cuda_ipc or nccl),
  KVReady follows; release: the engine frees its blocks here at once.
A failed hand-off tells the decode side (KVFailed, it frees the grant) and the coordinator
(WorkerError); a finished one tells the coordinator PrefillDone naming the grant, so that a grant
whose KVReady was lost on the way is freed all the same (coordinator: handoff_timeouts).
Peers are checked: a Prefill whose grant does not fit its tokens (dest_block_ids, one per block
of prompt + output, dest_cached_blocks below that) or whose token ids the engine refuses fails
at once with WorkerError, before any compute; the sender refuses block ids outside the
destination pool.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import zmq

from kvtransfer.transfer import KVSender
from runtime import structured
from runtime.config import EngineConfig, WorkerConfig
from runtime.cores import CoreShare, StaticCores
from runtime.engine import LLMEngine, StepOutput, build_model, drain_steps, prefix_report
from runtime.errors import PdserveError
from runtime.kv_cache import allocate_kv_cache
from runtime.weights import load_checkpoint
from wire import liveness, security
from wire.link import CoordinatorRestarted
from wire.protocol import Abort, Heartbeat, KVReady, Prefill, PrefillDone, Reject, Role, Shutdown, WorkerError
from worker import process

log = logging.getLogger("pdserve.prefill")


@dataclass
class Job:
    msg: Prefill
    t_start: float


class PrefillWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, pool: torch.Tensor, sender, link, batch_window_ms: float = 2.0,
                 ctx: zmq.Context | None = None, cores: CoreShare | StaticCores | None = None):
        self.worker_id = worker_id
        self.cores = cores or StaticCores()  # busy before each step, idle while waiting (runtime.cores)
        self.engine = engine  # in prefill mode
        self.pool = pool  # the engine's KV pool, (layers, 2, num_blocks, block_size, KVH, D): what hand-offs read
        self.sender = sender  # KVSender, or kvtransfer.local.LocalKV
        self.link = link  # WorkerLink, or anything with send, drain, start, stop, bad_messages, dropped
        self.batch_window = batch_window_ms / 1000
        self.ctx = ctx  # owned: destroyed by close()
        self.jobs: dict[str, Job] = {}
        self.running = True

    @classmethod
    def build(cls, engine_cfg: EngineConfig, wcfg: WorkerConfig) -> "PrefillWorker":
        if wcfg.threads:
            torch.set_num_threads(wcfg.threads)
        cores = CoreShare.open(wcfg.core_share)
        wid = process.worker_id(Role.PREFILL, wcfg)
        cfg, tensors = load_checkpoint(wcfg.model, progress=False, keep_quantized=engine_cfg.keep_quantized)
        structured.configure(model=wcfg.model)  # its tokenizer is loaded on the first structured request
        pool = allocate_kv_cache(cfg, engine_cfg.blocks_for_budget(cfg), engine_cfg.block_size, engine_cfg.torch_dtype, engine_cfg.device)
        engine = LLMEngine(build_model(cfg, tensors, engine_cfg), None, engine_cfg, kv_cache=pool, prefill_only=True)
        with cores.alone():
            profile = engine.profile(batches=(1, 4), prompt_len=128, decode_steps=0)
        ctx = zmq.Context()
        sender = KVSender(ctx, wid, security.worker_options(wcfg.keys, security.read_secret(wcfg.worker_secret_file)),
                          backend=wcfg.kv_backend)
        link = process.connect(ctx, wcfg, process.hello(Role.PREFILL, wid, wcfg, engine, pool, profile))
        return cls(wid, engine, pool, sender, link, wcfg.batch_window_ms, ctx, cores)

    def heartbeat(self) -> Heartbeat:
        sched = self.engine.scheduler
        return Heartbeat(
            self.worker_id, self.engine.blocks.free_blocks, len(sched.running), len(sched.waiting), self.engine.queued_tokens(),
            kv_bytes_sent=self.sender.bytes_sent, kv_seconds_sent=self.sender.seconds, bad_messages=self.link.bad_messages,
            steps=drain_steps(self.engine), inbox_dropped=self.link.dropped, **prefix_report(self.engine),
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
            if self.engine.runnable():
                self.cores.take_prefill_turn()
            else:  # only grammars compiling (on their own thread): the decode worker keeps the cores
                self.cores.idle()
            self.step()

    def close(self) -> None:
        self.cores.close()
        self.link.stop()
        self.sender.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)

    def handle(self, msg) -> None:
        if isinstance(msg, Prefill):
            self.on_prefill(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.request_id)
        elif isinstance(msg, CoordinatorRestarted):
            for rid in list(self.jobs):
                self.on_abort(rid)
        elif isinstance(msg, (Shutdown, Reject)):
            self.running = False

    def on_prefill(self, msg: Prefill) -> None:
        need = self.engine.blocks.blocks_for(len(msg.prompt_token_ids) + len(msg.output_token_ids))
        if len(msg.dest_block_ids) != need or not 0 <= msg.dest_cached_blocks < need:
            self.fail(msg, "kv_transfer_failed", f"invalid hand-off: granted {len(msg.dest_block_ids)} blocks "
                                                 f"({msg.dest_cached_blocks} cached) for {need} needed")
            return
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id, msg.output_token_ids, msg.priority)
        except PdserveError as e:
            self.fail(msg, e.code, str(e))
            return
        self.jobs[msg.request_id] = Job(msg, time.perf_counter())

    def on_abort(self, rid: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            self.engine.abort(rid)
            self.sender.fail(job.msg.dest_kv_endpoint, rid, "aborted", job.msg.grant)

    def wait_for_batch(self) -> None:
        """Hold the first prompt up to the batching window so later ones share its forward."""
        budget = self.engine.config.max_num_batched_tokens
        deadline = min(j.t_start for j in self.jobs.values()) + self.batch_window
        while time.perf_counter() < deadline and self.engine.queued_tokens() < budget:
            for msg in self.link.drain(max(0.0, deadline - time.perf_counter())):
                self.handle(msg)
            if not self.jobs:
                return

    def step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step()
        compute = time.perf_counter() - t0
        for out in outs:
            liveness.touch()  # each hand-off may wait up to the sender's timeout (10 s) for a dead decode worker
            job = self.jobs.pop(out.request_id, None)
            if job is None:
                continue
            if out.error is not None:  # its grammar did not compile (in budget)
                self.fail(job.msg, out.error.code, str(out.error))
                continue
            if out.token_id is None:  # could never fit this worker's pool
                self.fail(job.msg, "prompt_too_long", "prompt does not fit the prefill worker's KV pool")
                continue
            self.hand_off(job.msg, out, compute)
            self.engine.release(out.request_id)

    def hand_off(self, msg: Prefill, out: StepOutput, compute: float) -> None:
        """Send the KV of msg's prompt (and its first token) to the decode worker; report either way."""
        seq = self.engine.seqs[msg.request_id]
        skip = msg.dest_cached_blocks  # the decode worker holds these already
        ready = KVReady(
            msg.request_id, seq.prompt_token_ids, list(seq.output_token_ids), msg.params, msg.dest_block_ids[skip:],
            seq.num_computed_tokens, "", out.logprob, out.top_logprobs, msg.priority, msg.grant,  # the sender names its backend
        )
        t0 = time.perf_counter()
        try:
            if len(msg.dest_block_ids) != len(seq.block_table) or not 0 <= skip < len(seq.block_table):
                raise ValueError(f"granted {len(msg.dest_block_ids)} blocks ({skip} cached) for {len(seq.block_table)} needed")
            nbytes = self.sender.send(self.pool, seq.block_table[skip:], ready, msg.dest_kv_endpoint)
        except (OSError, ValueError, RuntimeError, zmq.ZMQError) as e:
            self.sender.fail(msg.dest_kv_endpoint, msg.request_id, f"hand-off failed: {e}", msg.grant)
            self.link.send(WorkerError(msg.request_id, "kv_transfer_failed", str(e)))
            return
        self.link.send(PrefillDone(msg.request_id, seq.num_computed_tokens, nbytes, time.perf_counter() - t0, compute, msg.grant))

    def fail(self, msg: Prefill, code: str, message: str) -> None:
        self.sender.fail(msg.dest_kv_endpoint, msg.request_id, message, msg.grant)
        self.link.send(WorkerError(msg.request_id, code, message))


def serve(engine_cfg: EngineConfig, worker_cfg: WorkerConfig) -> None:
    process.serve(process.build_or_exit(lambda: PrefillWorker.build(engine_cfg, worker_cfg)))
