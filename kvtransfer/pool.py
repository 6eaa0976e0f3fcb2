"""A worker's KV pool tensor, in private memory or in a /dev/shm file other processes can map.

Lifecycle: the decode worker `create`s its pool once; shared=True puts it in a file of this
user's 0700 pool directory with a random name (kvtransfer.pool_files: /dev/shm/pdserve-<uid>/
kv-<pid>-<start time>-<random>), after sweeping the pools there whose owners are gone. It announces
`path` in its Hello (and to its TP ranks) and `close`s the pool at exit, which unlinks the file.
Creating checks that the pool fits /dev/shm's free space and reserves it (fallocate), so a pool
too large fails at start with `ShmSpaceError` instead of a SIGBUS on first use; it holds an flock
on the file while it lives (proof of life for the sweep). A process on the same host (a prefill
worker, a TP rank) `attach`es by path, only through pool_files.open_peer_pool (a canonical path in
this user's pool directory, a regular file of ours of the expected size, else PoolRefused and
nothing mapped), and writes granted blocks straight into it; attaching never unlinks. torch maps
the file MAP_SHARED (through the checked fd), so no multiprocessing resource tracker is involved
(it would unlink a segment when an attacher exits). `copy_blocks` moves granted blocks between
two pools (shm and cuda_ipc write with it).
"""
from __future__ import annotations

import errno
import logging
import math
import os

import torch

from pdserve.kvtransfer.pool_files import create_pool_file, new_pool_path, open_peer_pool, shm_dir, sweep_dead_pools
from pdserve_client.errors import PdserveError

log = logging.getLogger("pdserve.kvpool")

# a pool's storage dtype by its wire name (KVAccept.kv_dtype); uint8 / float8_e4m3fn: a quantized
# KV cache (kernels.kv_quant, --kv-cache-dtype int8 / fp8), whose blocks carry their scales. int8:
# the symmetric, unrotated --kv-cache-dtype int8 rows of builds before 2026-12-08, named so that
# this build's hand-off refuses them by name (kvtransfer.transfer.check_same_storage); no pool of
# this build has that dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8, "int8": torch.int8,
          "float8_e4m3fn": torch.float8_e4m3fn}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


class ShmSpaceError(PdserveError):
    """The KV pool does not fit the shared-memory filesystem."""

    code = "shm_space"


def shm_free_bytes(directory: str | None = None) -> int:
    """Free bytes of the filesystem the pools live on (pool_files.shm_dir, or directory)."""
    st = os.statvfs(directory or shm_dir())
    return st.f_bavail * st.f_frsize


class KVPool:
    def __init__(self, tensor: torch.Tensor, path: str = "", owner: bool = False, lock_fd: int | None = None):
        self.tensor = tensor  # (layers, 2, num_blocks, block_size, KVH, D)
        self.path = path
        self.owner = owner
        self.lock_fd = lock_fd  # the creator's open, flocked file: proof it is alive

    @classmethod
    def create(cls, shape, dtype: torch.dtype, shared: bool) -> KVPool:
        if not shared:
            return cls(torch.zeros(shape, dtype=dtype))
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        sweep_dead_pools()
        path = new_pool_path()
        free = shm_free_bytes()
        if nbytes > free:
            raise ShmSpaceError(_too_big(nbytes, free))
        fd = create_pool_file(path)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserved now: another process filling /dev/shm cannot SIGBUS us later
            tensor = map_fd(fd, numel, dtype).view(shape)
        except BaseException as e:
            os.close(fd)
            os.unlink(path)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmSpaceError(_too_big(nbytes, shm_free_bytes())) from e
            raise
        return cls(tensor, path, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, path: str, shape, dtype: torch.dtype) -> KVPool:
        """Map a pool another process created (pool_files.PoolRefused, nothing mapped, unless it is one of ours of this shape)."""
        numel = math.prod(shape)
        fd = open_peer_pool(path, numel * torch.empty((), dtype=dtype).element_size())
        try:
            return cls(map_fd(fd, numel, dtype).view(shape), path)
        finally:
            os.close(fd)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        if self.owner and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _too_big(nbytes: int, free: int) -> str:
    return (f"the KV pool needs {nbytes / 2**20:.1f} MiB of shared memory but {shm_dir()} has {free / 2**20:.1f} MiB free: "
            "lower --kv-cache-mb (or --num-blocks), enlarge /dev/shm (docker run --shm-size=...) or point $PDSERVE_SHM_DIR "
            "at a larger tmpfs, or end what fills it")


def map_fd(fd: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The open file fd mapped MAP_SHARED as numel elements (through /proc/self/fd: the very file
    that was checked, whatever its path names now)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)


def block_runs(src: list[int], dst: list[int]):
    """Coalesce paired block ids into runs (src_start, dst_start, length) of consecutive ids."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    # dst, src: (layers, 2, num_blocks, block_size, KVH, D); block ids index dim 2
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])


def process_alive(pid: int) -> bool:
    """Whether process pid (on this machine) still exists and is not a zombie: a stopped one is alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc: ask the kernel (a zombie counts as alive here)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): two processes can share /dev/shm only if both match."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot
