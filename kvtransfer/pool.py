"""A worker's KV pool tensor, in private memory or in a /dev/shm file other processes can map.

Lifecycle: the decode worker `create`s its pool once (shared=True puts it in a file under
/dev/shm named after the worker), announces `path` in its Hello, and `close`s it at exit, which
unlinks the file. A prefill worker on the same host `attach`es by path and writes granted
blocks straight into it; attaching never unlinks. torch maps the file MAP_SHARED, so no
multiprocessing resource tracker is involved (it would unlink a segment when an attacher exits).
`copy_blocks` moves granted blocks between two pools (shm and cuda_ipc write with it).
"""
from __future__ import annotations

import math
import os
import uuid

import torch

SHM_DIR = "/dev/shm"
SHM_PREFIX = "pdserve-kv-"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


class KVPool:
    def __init__(self, tensor: torch.Tensor, path: str = "", owner: bool = False):
        self.tensor = tensor  # (layers, 2, num_blocks, block_size, KVH, D)
        self.path = path
        self.owner = owner

    @classmethod
    def create(cls, shape, dtype: torch.dtype, shared: bool, name: str | None = None) -> "KVPool":
        if not shared:
            return cls(torch.zeros(shape, dtype=dtype))
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{name or uuid.uuid4().hex[:12]}")
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # a sparse, zero-filled file
        finally:
            os.close(fd)
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        return cls(tensor, path, owner=True)

    @classmethod
    def attach(cls, path: str, shape, dtype: torch.dtype) -> "KVPool":
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


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): two processes can share /dev/shm only if both match."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot
