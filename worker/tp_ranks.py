"""A tensor-parallel worker's other ranks: started by rank 0, they run its steps until it stops.

Lifecycle: a worker's build calls `load_model(econf, wcfg, make_pool)`. Every rank's model, and
TP 1's, is built by runtime.build.build_model (given the rank group under TP n). With TP 1 it builds
runtime.model's LlamaModel. With TP n it makes the worker's KV pool shared (/dev/shm) and `start`s
ranks 1..n-1 as `python -m worker.tp_ranks SPEC` (SPEC: a msgspec JSON RankSpec on the command
line, no pickle, no secret: it names the group's private rendezvous directory, whose token the
rank reads there); rank 0 then joins their group (runtime.tp.RankGroup: loopback only, every
connection proven with the token) and builds its own part of the model (runtime.tp_model's TPModel), whose
every forward first broadcasts the step's plan. Each
other rank loads the checkpoint, keeps its shard, maps the worker's pool (only through
kvtransfer.pool_files' checks: a canonical path in this user's 0700 pool directory, a file of
ours of the pool's size, else PoolRefused and the rank stops; the same blocks; each
rank reads and writes its own KV heads, so one block id means the same tokens on every rank and
a hand-off moves whole blocks whatever the TP sizes) and follows rank 0's plans. Liveness both
ways: a rank whose parent (rank 0) is gone exits at once (a watch thread, and the kernel's
PDEATHSIG for a stopped one; a gloo collective with a dead peer fails at once too), and rank 0's
watch stops the worker as SIGTERM does (its launcher restarts it) within `WATCH_S` of any other
rank's exit, or, if the worker has not begun closing STOP_GRACE_S later (its step waits in an NCCL
collective for the dead rank), ends it at once. `Ranks.close()`, among what the worker closes,
sends stop, waits for the ranks, kills what does not leave, and removes the rendezvous directory
(as a failed `start` does).

On CUDA (NCCL; cupy needed) each rank runs on its own GPU (runtime.tp.rank_devices: more ranks
than GPUs is refused before any rank starts) with a pool of its own KV heads on that GPU
(cuda_ipc.CudaKVPool; the KV budget is per GPU, every rank gets the blocks the least of their
budgets buys: `rank_pool`), whose CUDA IPC export it publishes in the group's store; rank 0 maps every
other rank's pool and gives the worker `RankPools`: its own pool for its engine, and all of them
(kvtransfer.heads.HeadParts) for hand-offs, which then move each rank's heads straight between
GPUs (cuda_ipc) or through rank 0's GPU (nccl, tcp).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import torch

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.heads import HeadParts
from pdserve.kvtransfer.pool import KVPool, dtype_name
from pdserve.runtime.build import build_model
from pdserve.runtime.config import EngineConfig, ModelConfig, WorkerConfig
from pdserve.runtime.kv_cache import allocate_kv_cache, kv_cache_shape
from pdserve.runtime.tp import RankGroup, check_split, rank_devices
from pdserve.runtime.tp_model import TPModel
from pdserve.runtime.weights import load_checkpoint
from pdserve.wire.protocol import KVAccept

log = logging.getLogger("pdserve.tp")

WATCH_S = 0.2  # how often each side checks that the other ranks live
CLOSE_S = 5.0  # ranks still running this long after stop are killed
STOP_GRACE_S = 2.0  # a worker told to stop because a rank died exits at once if it has not begun closing by then


class RankSpec(msgspec.Struct):
    rank: int
    size: int
    rendezvous: str  # the group's private directory (runtime.tp.make_rendezvous): its store and token
    parent: int  # rank 0's pid: this rank exits when it is gone
    model: str | None
    engine: EngineConfig
    num_blocks: int  # the pool's blocks; on CUDA (0) each rank's budget buys its own and all take the least (rank_pool)
    threads: int | None = None
    pool_path: str = ""  # the worker's whole KV pool in /dev/shm ("": a pool of this rank's own; on CUDA, exported)


class Ranks:
    """Rank 0's handle on its model and the other rank processes."""

    def __init__(self, model: TPModel, procs: list[subprocess.Popen], group: RankGroup | None = None):
        self.model, self.procs, self.group = model, procs, group
        self.closing = False

    def watch(self, on_death) -> None:
        """Call on_death(message) once, from a thread, when another rank exits while not closing."""
        def loop():
            while not self.closing:
                dead = [p for p in self.procs if p.poll() is not None]
                if dead:
                    on_death(f"tensor-parallel rank (pid {dead[0].pid}) exited with {dead[0].returncode}")
                    return
                time.sleep(WATCH_S)

        threading.Thread(target=loop, name="tp-watch", daemon=True).start()

    def stop_worker(self, why: str) -> None:
        """Another rank died: stop this worker as SIGTERM does (its loop ends, its pool is
        unlinked; its launcher restarts it). A worker that has not begun closing STOP_GRACE_S later
        is waiting in a collective that will never end (NCCL waits for the dead rank on the GPU and
        the host in a sync no signal interrupts; torch's watchdog would end it only after the
        compute timeout): it exits at once, its step's tokens unsent (its launcher unlinks its pool)."""
        log.error("%s: stopping the worker", why)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while not self.closing and time.monotonic() < deadline:
            time.sleep(WATCH_S)
        if not self.closing:
            log.error("the worker did not stop within %g s (a collective waits for the dead rank): exiting now", STOP_GRACE_S)
            logging.shutdown()
            os._exit(1)

    def close(self) -> None:
        self.closing = True
        if all(p.poll() is None for p in self.procs):
            try:
                self.model.stop_followers()
            except RuntimeError:
                pass  # a rank is gone: the others fail their wait and leave
        deadline = time.monotonic() + CLOSE_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.group is not None:
            self.group.close()  # the rendezvous directory


def start(cfg: ModelConfig, tensors: dict, econf: EngineConfig, num_blocks: int, model: str | None = None,
          threads: int | None = None, pool_path: str = "") -> Ranks:
    """Rank 0: start ranks 1..n-1 (n: econf.tensor_parallel_size), join their group, build this
    rank's model from the whole checkpoint's tensors. pool_path: the worker's whole KV pool in
    /dev/shm, which every rank maps (each reads and writes its KV heads); "": each rank
    allocates a pool of its own KV heads."""
    n = econf.tensor_parallel_size
    check_split(cfg, n)  # refused before any process starts
    devices = rank_devices(econf.device, n, visible_gpus(econf.device))
    group = RankGroup(0, n, device=devices[0])  # makes the private rendezvous directory
    procs = []
    try:
        for r in range(1, n):
            rank_econf = econf if devices[r] == econf.device else dataclasses.replace(econf, device=devices[r])
            spec = RankSpec(r, n, group.rendezvous, os.getpid(), None if model is None else str(model), rank_econf, num_blocks, threads,
                            pool_path)
            procs.append(subprocess.Popen([sys.executable, "-P", "-m", "pdserve.worker.tp_ranks", msgspec.json.encode(spec).decode()],
                                          stdin=subprocess.DEVNULL, preexec_fn=_killed_with_parent()))
        group.connect()
        built = build_model(cfg, tensors, econf, model, group)
    except BaseException:
        for p in procs:
            p.kill()
        group.close()
        raise
    return Ranks(built, procs, group)


def load_model(econf: EngineConfig, wcfg: WorkerConfig, make_pool) -> tuple:
    """A worker's (model, KV pool, Ranks or None): TP 1 builds runtime.model as before; TP n
    starts the other ranks over the whole pool, made shared (make_pool(shape, shared)). The pool
    is sized once the weights are on the device (--gpu-memory-utilization measures what is left)."""
    if econf.device.startswith("cuda:"):
        torch.cuda.set_device(econf.device)  # kernels (Triton's too) launch on the current device: the worker's
    on_gpus = econf.tensor_parallel_size > 1 and econf.device.startswith("cuda")
    if on_gpus:
        _require_cupy()  # refused before the checkpoint loads
    cfg, tensors = load_checkpoint(wcfg.model, progress=False, keep_quantized=econf.keep_quantized)
    if econf.tensor_parallel_size == 1:
        model = build_model(cfg, tensors, econf, wcfg.model)
        return model, make_pool(kv_cache_shape(cfg, econf.blocks_for_budget(cfg), econf.block_size, econf.kv_torch_dtype), False), None
    check_split(cfg, econf.tensor_parallel_size)
    if on_gpus:
        return load_on_gpus(cfg, tensors, econf, wcfg.model)
    # the CPU: one pool of every head in /dev/shm, which every rank maps (the budget is the worker's)
    shape = kv_cache_shape(cfg, econf.blocks_for_budget(cfg), econf.block_size, econf.kv_torch_dtype)
    pool = make_pool(shape, True)
    threads = max(1, (wcfg.threads or torch.get_num_threads()) // econf.tensor_parallel_size)
    torch.set_num_threads(threads)
    try:
        ranks = start(cfg, tensors, econf, shape[2], wcfg.model, threads, pool.path)
    except BaseException:
        pool.close()
        raise
    del tensors
    release_heap()
    log.info("tensor parallel: %d ranks, this one %.1f MiB of weights", econf.tensor_parallel_size, ranks.model.weight_bytes() / 2**20)
    ranks.watch(ranks.stop_worker)
    return ranks.model, pool, ranks


def _require_cupy() -> None:
    try:
        cuda_ipc.require_cupy()  # the ranks' pools reach rank 0 (and hand-offs) over CUDA IPC
    except NotSupportedError as e:
        raise NotSupportedError(f"tensor parallelism on CUDA is not supported without cupy (its ranks share their KV pools "
                                f"over CUDA IPC): {e}") from e


def visible_gpus(device: str) -> int:
    """GPUs this process sees (0 for a CPU device: torch.cuda is not asked)."""
    return torch.cuda.device_count() if device.startswith("cuda") else 0


def load_on_gpus(cfg: ModelConfig, tensors: dict, econf: EngineConfig, model: str | None) -> tuple:
    """load_model on CUDA: ranks 1..n-1 on their GPUs, rank 0's pool and a mapping of theirs.
    Each rank's pool holds its KV heads on its GPU and gets the blocks its own budget buys
    (--kv-cache-mb and --gpu-memory-utilization are per GPU, as vLLM's): all take the least."""
    ranks = start(cfg, tensors, econf, 0, model)
    del tensors
    release_heap()
    try:
        own = rank_pool(ranks.model, econf)
        pool = RankPools.gather(own, ranks.model.group)
    except BaseException:
        ranks.close()
        raise
    log.info("tensor parallel on %d GPUs, this one %.1f MiB of weights", econf.tensor_parallel_size, ranks.model.weight_bytes() / 2**20)
    ranks.watch(ranks.stop_worker)
    return ranks.model, pool, ranks


def rank_pool(model: TPModel, econf: EngineConfig) -> cuda_ipc.CudaKVPool:
    """This rank's KV pool on its GPU: its KV heads, the blocks every rank's budget buys (each rank
    calls it once its weights are on its GPU, before the first step)."""
    blocks = model.group.agree_min(econf.blocks_for_budget(model.cfg))
    return cuda_ipc.CudaKVPool.create(kv_cache_shape(model.cfg, blocks, econf.block_size), econf.torch_dtype, model.device)


class RankPools:
    """Rank 0's KV pools on CUDA: `tensor`, its own (its engine's), and `parts`, every rank's in rank
    order (its own, then the others' mapped over CUDA IPC): what hand-offs read and write."""

    path = ""  # never in /dev/shm: shm does not apply

    def __init__(self, own: cuda_ipc.CudaKVPool, exports: list[KVAccept], unmap: list):
        self.own, self.exports, self.unmap = own, exports, unmap
        self.tensor = own.tensor
        self.parts = HeadParts([own.tensor] + [t for t, _ in unmap])

    @classmethod
    def gather(cls, own: cuda_ipc.CudaKVPool, group: RankGroup) -> RankPools:
        """Wait for ranks 1..n-1's exports (published in `follow`) and map them."""
        exports, mapped = [own.accept()], []
        try:
            for r in range(1, group.size):
                a = msgspec.msgpack.decode(group.fetch(export_key(r)), type=KVAccept)
                exports.append(a)
                mapped.append(cuda_ipc.map_export(a.device, a.ipc_handle, a.ipc_offset, a.kv_shape, cuda_ipc.DTYPES[a.kv_dtype]))
        except BaseException:
            for _, close in mapped:
                close()
            raise
        return cls(own, exports, mapped)

    @property
    def nbytes(self) -> int:
        return self.parts.nbytes

    def accept(self, nonce: int = 0) -> KVAccept:
        """The whole pool for KVReceiver: its shape with every head, each rank's export (ipc_parts)."""
        return KVAccept(nonce, list(self.parts.shape), dtype_name(self.parts.dtype), device=self.exports[0].device,
                        ipc_parts=[(a.device, a.ipc_handle, a.ipc_offset) for a in self.exports])

    def close(self) -> None:
        for _, close in self.unmap:
            try:
                close()
            except Exception:  # an exporter already gone: its memory went with it
                pass
        self.unmap = []
        self.own.close()


def handoff_pool(pool):
    """What a worker's hand-offs read and write: every rank's part on CUDA (RankPools), else the pool tensor."""
    return pool.parts if isinstance(pool, RankPools) else pool.tensor


def export_key(rank: int) -> str:
    return f"kv-export/{rank}"


def release_heap() -> None:
    """Give the whole checkpoint's freed memory back to the OS (glibc keeps freed heap pages
    otherwise), so a rank's resident memory holds its shard only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _killed_with_parent():
    """What a rank process runs before its exec: the kernel SIGKILLs it when rank 0's thread that
    started it ends (a stopped rank too, whose own watch cannot run); None where there is no glibc."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # loaded here, before the fork
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _watch_parent(parent: int) -> None:
    def loop():
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)  # rank 0 is gone: nothing here is worth a clean exit (no pool file, no socket of ours)

    threading.Thread(target=loop, name="tp-parent", daemon=True).start()


def follow(spec: RankSpec) -> None:
    """Ranks 1..n-1: build this rank's part and KV pool, run rank 0's steps until it stops."""
    _watch_parent(spec.parent)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    e = spec.engine  # its device: this rank's
    cfg, tensors = load_checkpoint(spec.model, progress=False, keep_quantized=e.keep_quantized)
    group = RankGroup(spec.rank, spec.size, spec.rendezvous, device=e.device).connect()
    model = build_model(cfg, tensors, e, spec.model, group)
    del tensors
    release_heap()
    if spec.pool_path:
        kv = KVPool.attach(spec.pool_path, kv_cache_shape(cfg, spec.num_blocks, e.block_size, e.kv_torch_dtype), e.kv_torch_dtype).tensor
    elif e.device.startswith("cuda"):  # its heads on its GPU, exported to rank 0
        pool = rank_pool(model, e)
        group.publish(export_key(spec.rank), msgspec.msgpack.encode(pool.accept()))
        kv = pool.tensor
    else:
        kv = allocate_kv_cache(model.cfg, spec.num_blocks, e.block_size, e.kv_torch_dtype, e.device)
    model.follow(kv)


if __name__ == "__main__":
    follow(msgspec.json.decode(sys.argv[1], type=RankSpec))
    logging.shutdown()
    os._exit(0)  # stopped by rank 0: nothing of this rank's needs tearing down (torch's and gloo's teardown can take seconds)
