"""Benchmark: decode-step paged attention on CPU, torch fast path vs the slow reference.

Lifecycle: run by hand from the repository root (`.venv/bin/python -m benchmarks.attention`);
builds one random decode batch (batch 32, context 512, 9 query / 3 kv heads, head_dim 64, block
16, shuffled pages), times each backend a few times and prints the median in milliseconds.
"""
from __future__ import annotations

import statistics
import time

import torch

from pdserve.kernels import paged

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 512, 9, 3, 64, 16
RUNS = 15


def decode_batch(dtype: torch.dtype):
    """q (B, H, D), paged caches and kwargs for one decode step of BATCH sequences of CONTEXT tokens."""
    g = torch.Generator().manual_seed(0)
    pages = CONTEXT // BLOCK
    num_blocks = BATCH * pages
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(BATCH, pages).int()
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=g).to(dtype)
    kwargs = dict(
        query_start_loc=torch.arange(BATCH + 1, dtype=torch.int32),
        seq_lens=torch.full((BATCH,), CONTEXT, dtype=torch.int32),
        block_tables=tables, max_query_len=1, scale=HEAD_DIM**-0.5,
    )
    return q, k_cache, v_cache, kwargs


def median_ms(fn, runs: int = RUNS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"decode B={BATCH} ctx={CONTEXT} H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} block={BLOCK}, "
          f"{torch.get_num_threads()} threads, median of {RUNS}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k_cache, v_cache, kw = decode_batch(dtype)
        fast = median_ms(lambda: paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw))
        ref = median_ms(lambda: paged.paged_attention(q, k_cache, v_cache, backend="reference", **kw))
        print(f"{str(dtype):15s} torch {fast:8.3f} ms   reference {ref:8.3f} ms   speed-up {ref / fast:5.1f}x")


if __name__ == "__main__":
    main()
