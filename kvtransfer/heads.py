"""A KV pool split by heads over a tensor-parallel GPU worker's ranks, and moving blocks between
pools of any split.

Lifecycle: on the CPU a tensor-parallel worker's ranks share one whole pool in /dev/shm, so its
hand-offs move whole blocks as TP 1's do (one part). On CUDA each rank's pool lives on its own GPU
and holds its KV heads (runtime.tp.kv_head_range); rank 0 maps the others' over CUDA IPC
(worker.tp_ranks) and gives the kv backends a `HeadParts`: the parts in rank order, which answers
what the backends ask of a pool tensor (shape with every head, dtype, device, nbytes). Every
backend reads and writes through the functions here, which take a plain tensor (one part) or
HeadParts alike, so a TP 1 pool goes the way it always went:
  copy_heads: each destination rank's heads, from whichever source ranks hold them
      (runtime.tp.head_routes: the one mapping, the forward's too), part to part (shm, cuda_ipc);
  gather_layer / scatter_layer: one layer's blocks with every head, assembled from the parts on
      one device / split into them (tcp and nccl, which move whole blocks);
  settle: wait for writes made into other ranks' parts from this process (before the header
      or the step that reads them).
"""
from __future__ import annotations

import math

import torch

from pdserve.kvtransfer.pool import copy_blocks
from pdserve.runtime.tp import head_routes, kv_head_range


class HeadParts:
    """A pool (layers, 2, num_blocks, block_size, KVH, D) held as N tensors, rank r's holding its
    KV heads (KVH / N) on its device; shape, dtype, device (rank 0's) as the whole pool's."""

    def __init__(self, parts: list[torch.Tensor]):
        first = parts[0]
        heads = first.shape[-2] * len(parts)
        for p in parts:
            if p.shape != first.shape or p.dtype != first.dtype:
                raise ValueError(f"pool parts differ: {tuple(p.shape)} {p.dtype} against {tuple(first.shape)} {first.dtype}")
        self.parts = parts
        self.shape = torch.Size([*first.shape[:-2], heads, first.shape[-1]])
        self.dtype = first.dtype
        self.device = first.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def element_size(self) -> int:
        return self.parts[0].element_size()


def as_parts(pool) -> list[torch.Tensor]:
    """A pool's parts in rank order: HeadParts' tensors, or a plain pool tensor as its one part."""
    return pool.parts if isinstance(pool, HeadParts) else [pool]


def block_bytes(pool) -> int:
    """Bytes of one block over every layer, K and V, and every head."""
    s = pool.shape
    return s[0] * s[1] * math.prod(s[3:]) * pool.element_size()


def _heads(t: torch.Tensor, heads: slice) -> torch.Tensor:
    return t[:, :, :, :, heads]  # (layers, 2, num_blocks, block_size, heads, D), a view


def copy_heads(dst, src, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy src's blocks src_ids into dst's dst_ids, each destination part's heads from the
    source parts that hold them (pools of the same shape, whatever their splits)."""
    d, s = as_parts(dst), as_parts(src)
    if len(d) == 1 and len(s) == 1:
        copy_blocks(d[0], s[0], src_ids, dst_ids)
        return
    for r in head_routes(dst.shape[-2], len(s), len(d)):
        copy_blocks(_heads(d[r.dst], r.dst_heads), _heads(s[r.src], r.src_heads), src_ids, dst_ids)


def gather_layer(pool, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """Layer's blocks idx with every head, (2, n, block_size, KVH, D), on the pool's (rank 0's) device."""
    parts = as_parts(pool)
    pieces = [p[layer].index_select(1, idx.to(p.device)).to(pool.device) for p in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)


def scatter_layer(pool, layer: int, idx: torch.Tensor, data: torch.Tensor) -> None:
    """Write data (2, n, block_size, KVH, D) into layer's blocks idx, each part its heads."""
    parts = as_parts(pool)
    for r, p in enumerate(parts):
        lo, hi = kv_head_range(pool.shape[-2], r, len(parts))
        piece = (data if len(parts) == 1 else data[..., lo:hi, :]).to(p.device)
        as_bytes(p[layer]).index_copy_(1, idx.to(p.device), as_bytes(piece))  # torch has no float8 index_copy_


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A pool of a 1-byte dtype (int8, float8: a quantized KV cache) as uint8, a view: torch has no float8 index_copy_."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def settle(pool) -> None:
    """Wait for this process's writes into other ranks' parts (their GPUs' streams are not ours to order)."""
    for p in as_parts(pool)[1:]:
        if p.is_cuda:
            torch.cuda.synchronize(p.device)
