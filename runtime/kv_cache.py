"""The paged KV cache: one tensor of pages and the block manager that hands them out.

Lifecycle: a worker allocates the pool once (`allocate_kv_cache`, optionally over a buffer it
shares with other processes) and builds one `BlockManager` over its block ids. Sequences grow
their block tables through `BlockManager.ensure_slots`, which answers False, never raises, when
the pool is short, so the scheduler can preempt; `free_table` gives every block back. Ref counts
let a block be shared (a forked or prefix-shared sequence); a block returns to the free list
when its count reaches zero. At shutdown `free_blocks == num_blocks` is the leak check.
"""
from __future__ import annotations

from collections import deque

import torch

from runtime.config import ModelConfig


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    # (layers, 2, num_blocks, block_size, KVH, D); zeros so an unwritten page is harmless if read
    return torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype, device=device)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (nothing taken) when fewer are free."""
        if n > len(self.free_ids):
            return None
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} is free and cannot be shared")
            self.ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    def ensure_slots(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table (in place) to hold num_tokens tokens; False if the pool is short."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need <= 0:
            return True
        ids = self.allocate(need)
        if ids is None:
            return False
        block_table.extend(ids)
        return True

    def free_table(self, block_table: list[int]) -> None:
        self.free(block_table)
        block_table.clear()

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size
