"""Prefix-cache block keys: a full KV block's tokens hashed, chained to the previous block's key.

Lifecycle: pure functions, no state and no torch, so the coordinator (placement by cached
prefix) and `wire` (through runtime.sequence) may import it. Every process computes the same key
for the same tokens at the same block position and block size (blake2b, 64 bits), which is what
lets a worker's heartbeat name its cached blocks to the coordinator.
"""
from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0  # the chain's start: the key "before" a sequence's first block


def block_hash(prev: int, tokens: list[int]) -> int:
    """A full block's key: its tokens chained to the previous block's key (64 bits, the same in
    every process, so the coordinator can compare the keys workers report)."""
    h = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: list[int], block_size: int, upto_blocks: int | None = None, known: list[int] | None = None) -> list[int]:
    """The chained hashes of tokens' full blocks (at most upto_blocks), extending `known` (a prefix of them)."""
    out = list(known or [])
    n = len(tokens) // block_size if upto_blocks is None else min(upto_blocks, len(tokens) // block_size)
    prev = out[-1] if out else ROOT_HASH
    for i in range(len(out), n):
        prev = block_hash(prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
