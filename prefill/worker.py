"""The prefill worker (`pdserve prefill`): prompt forward passes, first token, KV hand-off.

Lifecycle: load the model with a private KV pool, say Hello. Then loop:
  drain the inbox: Prefill -> queue the prompt with its destination (decode worker, granted
  block ids, backend); Abort -> drop it if not yet handed off, telling the decode side;
  batching window: once a prompt waits, wait up to `batch_window_ms` (or until the token
  budget is full) so several prompts pack into one forward;
  step: the runtime scheduler packs waiting prompts up to the token budget and chunks long
  ones; a prompt whose last chunk ran samples its first token, its blocks are sent to the
  decode worker (shm: written into its pool; tcp: frames), KVReady follows, and its blocks
  here are freed at once. A failed hand-off tells the decode side (KVFailed, it frees the
  grant) and the coordinator (WorkerError).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import torch
import zmq

from coordinator import security
from coordinator.link import CoordinatorRestarted, WorkerLink
from coordinator.protocol import (
    PROTOCOL_VERSION, Abort, Heartbeat, Hello, KVReady, Prefill, PrefillDone, Reject, Role, Shutdown, WorkerError,
)
from kvtransfer.pool import host_identity
from kvtransfer.cuda_ipc import device_id
from kvtransfer.transfer import KVSender, gpu_backends
from runtime import structured
from runtime.config import EngineConfig, WorkerConfig
from runtime.engine import LLMEngine, build_model, drain_steps
from runtime.errors import PdserveError
from runtime.heap import freeze_startup_heap
from runtime.sequence import FinishReason, Sequence
from runtime.weights import load_checkpoint

log = logging.getLogger("pdserve.prefill")


@dataclass
class Handoff:
    msg: Prefill
    seq: Sequence
    t_start: float


class PrefillWorker:
    def __init__(self, engine_cfg: EngineConfig, worker_cfg: WorkerConfig):
        self.wcfg = worker_cfg
        if worker_cfg.threads:
            torch.set_num_threads(worker_cfg.threads)
        self.worker_id = worker_cfg.worker_id or f"prefill-{os.getpid()}"
        cfg, tensors = load_checkpoint(worker_cfg.model, progress=False)
        structured.configure(model=worker_cfg.model)  # its tokenizer is loaded on the first structured request
        self.engine = LLMEngine(build_model(cfg, tensors, engine_cfg), None, engine_cfg)
        self.scheduler = self.engine.scheduler
        profile = self.engine.profile(batches=(1, 4), prompt_len=128, decode_steps=0)
        self.ctx = zmq.Context()
        self.sender = KVSender(self.ctx, self.worker_id, security.client_options(worker_cfg.keys))
        host, boot = host_identity()
        hello = Hello(
            PROTOCOL_VERSION, self.worker_id, int(Role.PREFILL), os.getpid(), host, boot, str(worker_cfg.model or "default"),
            self.engine.max_model_len, self.engine.blocks.num_blocks, engine_cfg.block_size, profile=profile,
            kv_device=device_id(self.engine.runner.kv_cache), kv_backends=gpu_backends(self.engine.runner.kv_cache),
            engine=engine_cfg.summary(self.engine.max_model_len, self.engine.blocks.num_blocks, self.engine.runner.kv_cache.nbytes),
        )
        self.link = WorkerLink(self.ctx, worker_cfg.coordinator, hello, self.heartbeat, worker_cfg.heartbeat_s,
                               security.client_options(worker_cfg.keys))
        self.jobs: dict[str, Handoff] = {}
        self.running = True

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            self.worker_id, self.engine.blocks.free_blocks, len(self.scheduler.running), len(self.scheduler.waiting),
            sum(j.seq.num_uncomputed for j in list(self.jobs.values())), kv_bytes_sent=self.sender.bytes_sent,
            kv_seconds_sent=self.sender.seconds, bad_messages=self.link.bad_messages, steps=drain_steps(self.engine),
            inbox_dropped=self.link.dropped,
        )

    def run(self) -> None:
        self.link.start()
        try:
            while self.running:
                for msg in self.link.drain(0 if self.jobs else 0.05):
                    self.handle(msg)
                if self.jobs:
                    self.wait_for_batch()
                    self.step()
        finally:
            self.link.stop()
            self.sender.close()
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
        seq = Sequence(msg.request_id, msg.prompt_token_ids, msg.params, msg.output_token_ids, msg.priority)
        try:
            self.engine.validate(seq.prompt_token_ids + seq.output_token_ids, msg.params)
        except PdserveError as e:
            self.fail(msg, e.code, str(e))
            return
        self.jobs[msg.request_id] = Handoff(msg, seq, time.perf_counter())
        self.scheduler.add(seq)

    def on_abort(self, rid: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            self.scheduler.finish(job.seq, FinishReason.ABORT)
            self.sender.fail(job.msg.dest_kv_endpoint, rid, "aborted")

    def wait_for_batch(self) -> None:
        """Hold the first prompt up to the batching window so later ones share its forward."""
        window = self.wcfg.batch_window_ms / 1000
        budget = self.scheduler.max_num_batched_tokens
        deadline = min(j.t_start for j in self.jobs.values()) + window
        while time.perf_counter() < deadline and self.heartbeat().queued_tokens < budget:
            msgs = self.link.drain(max(0.0, deadline - time.perf_counter()))
            for msg in msgs:
                self.handle(msg)
            if not self.jobs:
                return

    def step(self) -> None:
        sched = self.scheduler.schedule()
        for seq in sched.finished:  # could never fit this worker's pool
            job = self.jobs.pop(seq.request_id)
            self.fail(job.msg, "prompt_too_long", "prompt does not fit the prefill worker's KV pool")
        if not sched.scheduled:
            return
        t0 = time.perf_counter()
        samplers, sampled = self.engine.execute(sched.scheduled)
        compute = time.perf_counter() - t0
        for i, seq in enumerate(samplers):
            self.hand_off(self.jobs.pop(seq.request_id), sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i], compute)

    def hand_off(self, job: Handoff, token: int, logprob, top, compute: float) -> None:
        seq, msg = job.seq, job.msg
        n_blocks = self.engine.blocks.blocks_for(seq.num_tokens)
        ready = KVReady(
            msg.request_id, seq.prompt_token_ids, seq.output_token_ids + [token], msg.params, msg.dest_block_ids,
            seq.num_tokens, msg.backend, logprob, top, msg.priority,
        )
        t0 = time.perf_counter()
        try:
            if len(msg.dest_block_ids) != n_blocks:
                raise ValueError(f"granted {len(msg.dest_block_ids)} blocks for {n_blocks} needed")
            nbytes = self.sender.send(self.engine.runner.kv_cache, seq.block_table[:n_blocks], ready, msg.dest_kv_endpoint, msg.dest_shm_path, msg.dest_kv_shape)
        except (OSError, ValueError, RuntimeError, zmq.ZMQError) as e:
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.sender.fail(msg.dest_kv_endpoint, msg.request_id, f"hand-off failed: {e}")
            self.link.send(WorkerError(msg.request_id, "kv_transfer_failed", str(e)))
            return
        self.scheduler.finish(seq, FinishReason.STOP)
        self.link.send(PrefillDone(msg.request_id, seq.num_tokens, nbytes, time.perf_counter() - t0, compute))

    def fail(self, msg: Prefill, code: str, message: str) -> None:
        self.sender.fail(msg.dest_kv_endpoint, msg.request_id, message)
        self.link.send(WorkerError(msg.request_id, code, message))


def serve(engine_cfg: EngineConfig, worker_cfg: WorkerConfig) -> None:
    worker = PrefillWorker(engine_cfg, worker_cfg)
    freeze_startup_heap()

    def stop(*_):
        worker.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
