"""A tensor-parallel worker's other ranks: started by rank 0, they run its steps until it stops.

Lifecycle: a worker's build calls `load_model(econf, wcfg, make_pool)`. With TP 1 it builds
runtime.model as before. With TP n it makes the worker's KV pool shared (/dev/shm) and `start`s
ranks 1..n-1 as `python -m worker.tp_ranks SPEC` (SPEC: a msgspec JSON RankSpec on the command
line, no pickle); rank 0 then joins their group (runtime.tp.RankGroup) and builds its own part
of the model (runtime.tp_model), whose every forward first broadcasts the step's plan. Each
other rank loads the checkpoint, keeps its shard, maps the worker's pool (the same blocks; each
rank reads and writes its own KV heads, so one block id means the same tokens on every rank and
a hand-off moves whole blocks whatever the TP sizes) and follows rank 0's plans. Liveness both
ways: a rank whose parent (rank 0) is gone exits at once (a watch thread; a collective with a
dead peer fails at once too), and rank 0's watch stops the worker as SIGTERM does (its launcher
restarts it) within `WATCH_S` of any other rank's exit. `Ranks.close()`, among what the worker
closes, sends stop, waits for the ranks, kills what does not leave.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import torch

from kvtransfer.pool import KVPool
from runtime.config import EngineConfig, ModelConfig, WorkerConfig
from runtime.engine import build_model
from runtime.kv_cache import allocate_kv_cache, kv_cache_shape
from runtime.tp import RankGroup, check_split
from runtime.tp_model import TPModel, build_tp_model
from runtime.weights import load_checkpoint

log = logging.getLogger("pdserve.tp")

WATCH_S = 0.2  # how often each side checks that the other ranks live
CLOSE_S = 5.0  # ranks still running this long after stop are killed


class RankSpec(msgspec.Struct):
    rank: int
    size: int
    port: int
    parent: int  # rank 0's pid: this rank exits when it is gone
    model: str | None
    engine: EngineConfig
    num_blocks: int
    threads: int | None = None
    pool_path: str = ""  # the worker's whole KV pool in /dev/shm ("": a pool of this rank's own)


class Ranks:
    """Rank 0's handle on its model and the other rank processes."""

    def __init__(self, model: TPModel, procs: list[subprocess.Popen]):
        self.model, self.procs = model, procs
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


def start(cfg: ModelConfig, tensors: dict, econf: EngineConfig, num_blocks: int, model: str | None = None,
          threads: int | None = None, pool_path: str = "") -> Ranks:
    """Rank 0: start ranks 1..n-1 (n: econf.tensor_parallel_size), join their group, build this
    rank's model from the whole checkpoint's tensors. pool_path: the worker's whole KV pool in
    /dev/shm, which every rank maps (each reads and writes its KV heads); "": each rank
    allocates a pool of its own KV heads."""
    n = econf.tensor_parallel_size
    check_split(cfg, n)  # refused before any process starts
    group = RankGroup(0, n)
    procs = []
    for r in range(1, n):
        spec = RankSpec(r, n, group.port, os.getpid(), None if model is None else str(model), econf, num_blocks, threads, pool_path)
        procs.append(subprocess.Popen([sys.executable, "-m", "worker.tp_ranks", msgspec.json.encode(spec).decode()],
                                      cwd=_repo_root(), stdin=subprocess.DEVNULL))
    try:
        group.connect()
        built = build_tp_model(cfg, tensors, econf, group)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return Ranks(built, procs)


def load_model(econf: EngineConfig, wcfg: WorkerConfig, make_pool) -> tuple:
    """A worker's (model, KV pool, Ranks or None): TP 1 builds runtime.model as before; TP n
    starts the other ranks over the whole pool, made shared (make_pool(shape, shared))."""
    cfg, tensors = load_checkpoint(wcfg.model, progress=False, keep_quantized=econf.keep_quantized)
    shape = kv_cache_shape(cfg, econf.blocks_for_budget(cfg), econf.block_size)
    if econf.tensor_parallel_size == 1:
        model = build_model(cfg, tensors, econf)
        return model, make_pool(shape, False), None
    check_split(cfg, econf.tensor_parallel_size)
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
    ranks.watch(_stop_worker)
    return ranks.model, pool, ranks


def release_heap() -> None:
    """Give the whole checkpoint's freed memory back to the OS (glibc keeps freed heap pages
    otherwise), so a rank's resident memory holds its shard only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _stop_worker(why: str) -> None:
    """A rank died: stop this worker as SIGTERM does (its loop ends, its pool is unlinked); its launcher restarts it."""
    log.error("%s: stopping the worker", why)
    os.kill(os.getpid(), signal.SIGTERM)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    e = spec.engine
    cfg, tensors = load_checkpoint(spec.model, progress=False, keep_quantized=e.keep_quantized)
    group = RankGroup(spec.rank, spec.size, spec.port).connect()
    model = build_tp_model(cfg, tensors, e, group)
    del tensors
    release_heap()
    if spec.pool_path:
        kv = KVPool.attach(spec.pool_path, kv_cache_shape(cfg, spec.num_blocks, e.block_size), e.torch_dtype).tensor
    else:
        kv = allocate_kv_cache(model.cfg, spec.num_blocks, e.block_size, e.torch_dtype, e.device)
    model.follow(kv)


if __name__ == "__main__":
    follow(msgspec.json.decode(sys.argv[1], type=RankSpec))
    logging.shutdown()
    os._exit(0)  # stopped by rank 0: nothing of this rank's needs tearing down (torch's and gloo's teardown can take seconds)
