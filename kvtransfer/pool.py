"""A worker's KV pool tensor, in private memory or in a /dev/shm file other processes can map.

Lifecycle: the decode worker `create`s its pool once (shared=True puts it in a file under
/dev/shm named after the worker), announces `path` in its Hello, and `close`s it at exit, which
unlinks the file. Creating checks that the pool fits /dev/shm's free space and reserves it
(fallocate), so a pool too large fails at start with `ShmSpaceError` instead of a SIGBUS on
first use; it holds an flock on the file while it lives, so a file of the same name nobody
holds (left by a dead worker whose pid was reused) is stale and removed first. A prefill worker on the same host `attach`es by path and writes granted
blocks straight into it; attaching never unlinks. torch maps the file MAP_SHARED, so no
multiprocessing resource tracker is involved (it would unlink a segment when an attacher exits).
`copy_blocks` moves granted blocks between two pools (shm and cuda_ipc write with it).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import uuid

import torch

from pdserve_client.errors import PdserveError

log = logging.getLogger("pdserve.kvpool")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "pdserve-kv-"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


class ShmSpaceError(PdserveError):
    """The KV pool does not fit the shared-memory filesystem (or its name is held by a live process)."""

    code = "shm_space"


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class KVPool:
    def __init__(self, tensor: torch.Tensor, path: str = "", owner: bool = False, lock_fd: int | None = None):
        self.tensor = tensor  # (layers, 2, num_blocks, block_size, KVH, D)
        self.path = path
        self.owner = owner
        self.lock_fd = lock_fd  # the creator's open, flocked file: proof it is alive

    @classmethod
    def create(cls, shape, dtype: torch.dtype, shared: bool, name: str | None = None) -> KVPool:
        if not shared:
            return cls(torch.zeros(shape, dtype=dtype))
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{name or uuid.uuid4().hex[:12]}")
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        remove_stale(path)
        free = shm_free_bytes()
        if nbytes > free:
            raise ShmSpaceError(_too_big(nbytes, free))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, nbytes)  # reserved now: another process filling /dev/shm cannot SIGBUS us later
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmSpaceError(_too_big(nbytes, shm_free_bytes())) from e
            raise
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        return cls(tensor, path, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, path: str, shape, dtype: torch.dtype) -> KVPool:
        if not path.startswith(os.path.join(SHM_DIR, SHM_PREFIX)):
            raise ValueError(f"refusing to map {path!r}: not a pdserve KV pool")
        numel = math.prod(shape)
        expect = numel * torch.empty((), dtype=dtype).element_size()
        if os.path.getsize(path) != expect:
            raise ValueError(f"{path} holds {os.path.getsize(path)} bytes, expected {expect} for shape {list(shape)}")
        return cls(torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape), path)

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
    return (f"the KV pool needs {nbytes / 2**20:.1f} MiB of shared memory but {SHM_DIR} has {free / 2**20:.1f} MiB free: "
            "lower --kv-cache-mb (or --num-blocks), enlarge /dev/shm (docker run --shm-size=...), or end what fills it")


def remove_stale(path: str) -> None:
    """Remove a pool file of this name that no live process holds (its creator died, its pid was
    reused for us); one still held by a live creator is an error, never touched."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ShmSpaceError(f"{path} exists and is held by a live process") from None
    finally:
        os.close(fd)
    log.warning("removing %s: a stale KV pool a dead worker left", path)
    os.unlink(path)


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
