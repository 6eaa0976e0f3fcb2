"""The decode worker (`pdserve decode`), and in colocated mode the whole engine in one worker.

Lifecycle: load the model, put the KV pool in shared memory (on a GPU: one CUDA allocation
that prefill workers map over CUDA IPC; its size from the memory budget, logged at start), bind the kv socket, say Hello. Then loop:
  drain the inbox: Admit -> reserve blocks (Granted | AdmitRefused); KVReady -> copy tcp frames
  into the granted blocks, join the running batch, emit the prefill's first token at once;
  Generate (colocated) -> queue for chunked prefill here; Abort / Release -> free;
  step the engine (continuous batching: joiners enter at the next step, finished sequences
  leave at once, a short pool preempts the newest sequence, which is recomputed here);
  send the step's tokens as one TokenBatch; expire grants whose KV never came.
Every block is freed on every path: finish, abort, release, failed hand-off, grant timeout.
On exit the shared pool file is unlinked.
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
    PROTOCOL_VERSION, Abort, Admit, AdmitRefused, Generate, Granted, Heartbeat, Hello, KVFailed, KVReady, Reject, Release,
    Role, Shutdown, TokenBatch, TokenOut, WorkerError,
)
from kvtransfer.cuda_ipc import CudaKVPool, device_id, gpu_pool
from kvtransfer.errors import KVTransferError
from kvtransfer.pool import KVPool, dtype_name, host_identity
from kvtransfer.transfer import KVReceiver, gpu_backends
from runtime import cuda_graphs, structured
from runtime.config import EngineConfig, WorkerConfig
from runtime.engine import LLMEngine, StepOutput, build_model, drain_steps
from runtime.errors import PdserveError
from runtime.heap import freeze_startup_heap
from runtime.kv_cache import kv_cache_shape
from runtime.weights import load_checkpoint

log = logging.getLogger("pdserve.decode")


@dataclass
class Grant:
    block_ids: list[int]
    deadline: float
    cancelled: bool = False  # aborted before its KV arrived: free when the prefill side answers


def token_out(o: StepOutput) -> TokenOut:
    return TokenOut(
        o.request_id, -1 if o.token_id is None else o.token_id, o.logprob, o.top_logprobs,
        -1 if o.finish_reason is None else int(o.finish_reason),
    )


class DecodeWorker:
    def __init__(self, engine_cfg: EngineConfig, worker_cfg: WorkerConfig, role: Role = Role.DECODE):
        self.role = role
        self.wcfg = worker_cfg
        if worker_cfg.threads:
            torch.set_num_threads(worker_cfg.threads)
        self.worker_id = worker_cfg.worker_id or f"{role.name.lower()}-{os.getpid()}"
        cfg, tensors = load_checkpoint(worker_cfg.model, progress=False)
        structured.configure(model=worker_cfg.model)  # its tokenizer is loaded on the first structured request
        model = build_model(cfg, tensors, engine_cfg)
        num_blocks = engine_cfg.blocks_for_budget(cfg)
        shape = kv_cache_shape(cfg, num_blocks, engine_cfg.block_size)
        if engine_cfg.device.startswith("cuda"):  # on the GPU, exported over CUDA IPC when cupy is here
            self.pool = gpu_pool(shape, engine_cfg.torch_dtype, engine_cfg.device)
        else:
            self.pool = KVPool.create(shape, engine_cfg.torch_dtype, shared=worker_cfg.shared_pool, name=f"{os.getpid()}")
        self.engine = LLMEngine(model, None, engine_cfg, kv_cache=self.pool.tensor)
        if engine_cfg.device.startswith("cuda") and engine_cfg.cuda_graphs:
            cuda_graphs.enable(self.engine)
        log.info(
            "%s: KV pool %d blocks x %d tokens = %d tokens (%.1f MiB)%s", self.worker_id, num_blocks, engine_cfg.block_size,
            num_blocks * engine_cfg.block_size, self.pool.nbytes / 2**20, f" in {self.pool.path}" if self.pool.path else "",
        )
        profile = self.engine.profile()
        security.check_bind(worker_cfg.kv_bind, worker_cfg.keys, worker_cfg.insecure)
        self.ctx = zmq.Context()
        self.auth = security.start_authenticator(self.ctx, worker_cfg.keys)
        self.receiver = KVReceiver(self.ctx, self.pool.tensor, worker_cfg.kv_bind, security.server_options(worker_cfg.keys),
                                   ipc=self.pool.accept() if isinstance(self.pool, CudaKVPool) else None)
        host, boot = host_identity()
        hello = Hello(
            PROTOCOL_VERSION, self.worker_id, int(role), os.getpid(), host, boot, str(worker_cfg.model or "default"),
            self.engine.max_model_len, num_blocks, engine_cfg.block_size, self.receiver.endpoint, self.pool.path,
            list(shape), dtype_name(engine_cfg.torch_dtype), profile,
            kv_device=device_id(self.pool.tensor), kv_backends=gpu_backends(self.pool.tensor),
            engine=engine_cfg.summary(self.engine.max_model_len, num_blocks, self.pool.nbytes),
        )
        self.link = WorkerLink(self.ctx, worker_cfg.coordinator, hello, self.heartbeat, worker_cfg.heartbeat_s,
                               security.client_options(worker_cfg.keys))
        self.link.watch(self.receiver.sock, lambda sock: self.receiver.recv())
        self.grants: dict[str, Grant] = {}
        self.running = True

    # ------------------------------------------------------------------ loop

    def heartbeat(self) -> Heartbeat:
        sched = self.engine.scheduler
        return Heartbeat(
            self.worker_id, self.engine.blocks.free_blocks, len(sched.running), len(sched.waiting),
            sum(s.num_uncomputed for s in list(sched.waiting)), kv_bytes_received=self.receiver.bytes_received,
            bad_messages=self.receiver.bad_messages + self.link.bad_messages, preemptions=sched.num_preemptions,
            steps=drain_steps(self.engine), inbox_dropped=self.link.dropped,
        )

    def run(self) -> None:
        self.link.start()
        try:
            while self.running:
                busy = self.engine.has_work()
                for msg in self.link.drain(0 if busy else 0.05):
                    self.handle(msg)
                if self.engine.has_work():
                    self.emit(self.engine.step())
                self.expire_grants()
        finally:
            self.close()

    def close(self) -> None:
        self.link.stop()
        self.receiver.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)
        self.pool.close()

    def emit(self, outs: list[StepOutput]) -> None:
        if outs:
            self.link.send(TokenBatch([token_out(o) for o in outs]))

    # ------------------------------------------------------------------ messages

    def handle(self, msg) -> None:
        if isinstance(msg, tuple):  # (KVReady | KVFailed, frames) from the kv socket
            self.on_kv(*msg)
        elif isinstance(msg, Admit):
            self.on_admit(msg)
        elif isinstance(msg, Generate):
            self.on_generate(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.request_id)
        elif isinstance(msg, Release):
            self.free_grant(msg.request_id)
        elif isinstance(msg, CoordinatorRestarted):
            self.abort_all()
        elif isinstance(msg, (Shutdown, Reject)):
            self.running = False

    def abort_all(self) -> None:
        """The coordinator that placed our requests is gone: end them all, free every block."""
        log.warning("coordinator restarted: aborting %d requests", len(self.engine.seqs) + len(self.grants))
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        for grant in self.grants.values():
            grant.cancelled = True  # freed when the prefill side answers, or at the grant deadline

    def on_admit(self, msg: Admit) -> None:
        self.free_grant(msg.request_id)  # a newer admission of the same request replaces the old grant
        blocks = self.engine.blocks
        ids = blocks.allocate(blocks.blocks_for(msg.num_tokens)) if msg.num_tokens > 0 else None
        if ids is None:
            self.link.send(AdmitRefused(msg.request_id, f"kv pool short: {blocks.free_blocks} blocks free", msg.admission))
            return
        self.grants[msg.request_id] = Grant(ids, time.monotonic() + self.wcfg.grant_timeout_s)
        self.link.send(Granted(msg.request_id, ids, msg.admission))

    def on_kv(self, msg, frames) -> None:
        grant = self.grants.pop(msg.request_id, None)
        if grant is None:
            return  # released already (timeout or prefill worker lost): nothing to free
        if isinstance(msg, KVFailed) or grant.cancelled or msg.block_ids != grant.block_ids:
            self.engine.blocks.free(grant.block_ids)
            if isinstance(msg, KVFailed) and not grant.cancelled:
                self.link.send(WorkerError(msg.request_id, "kv_transfer_failed", msg.reason))
            return
        try:
            self.receiver.copy_in(msg, frames)
        except KVTransferError as e:  # nccl: the blocks never arrived; the communicator is already dropped
            self.engine.blocks.free(grant.block_ids)
            self.link.send(WorkerError(msg.request_id, e.code, str(e)))
            return
        out = self.engine.add_prefilled(
            msg.request_id, msg.prompt_token_ids, msg.output_token_ids, msg.params, grant.block_ids,
            msg.num_computed, msg.logprob, msg.top_logprobs, msg.priority,
        )
        self.emit([out])

    def on_generate(self, msg: Generate) -> None:
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id, msg.output_token_ids, msg.priority)
        except PdserveError as e:
            self.link.send(WorkerError(msg.request_id, e.code, str(e)))

    def on_abort(self, rid: str) -> None:
        if rid in self.grants:
            self.grants[rid].cancelled = True  # the prefill side may still be writing into it
        elif self.engine.abort(rid):
            self.emit([StepOutput(rid, None, finish_reason=2)])

    def free_grant(self, rid: str) -> None:
        grant = self.grants.pop(rid, None)
        if grant is not None:
            self.engine.blocks.free(grant.block_ids)

    def expire_grants(self) -> None:
        if not self.grants:
            return
        now = time.monotonic()
        for rid in [r for r, g in self.grants.items() if g.deadline < now]:
            log.warning("grant for %s expired without KV; freeing its blocks", rid)
            if not self.grants[rid].cancelled:
                self.link.send(WorkerError(rid, "kv_transfer_timeout", "prefill hand-off never arrived"))
            self.free_grant(rid)


def serve(engine_cfg: EngineConfig, worker_cfg: WorkerConfig, role: Role = Role.DECODE) -> None:
    worker = DecodeWorker(engine_cfg, worker_cfg, role)
    freeze_startup_heap()

    def stop(*_):
        worker.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
