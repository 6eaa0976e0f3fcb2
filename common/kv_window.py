"""Which KV blocks a sliding window leaves behind a sequence: shared by the block manager
(runtime/kv_cache.py), which frees them as the sequence grows and grants none for them in a
hand-off, and the coordinator (coordinator/placement.py), which counts only the others in the
room a hand-off needs.

Lifecycle: a pure function, called per step and per placement.
"""
from __future__ import annotations


def first_needed_block(num_computed: int, window: int, block_size: int) -> int:
    """The index of the first block a sequence with num_computed tokens computed reads again,
    when every layer slides over `window` keys (0: none does, every block is read): its next
    query, at position num_computed, sees keys from num_computed - window + 1 on, so the blocks
    before lie wholly outside every window. The block before the one being filled is kept too:
    its prefix-cache link chains the next block's key (a window shorter than a block would
    otherwise drop it first)."""
    if window <= 0:
        return 0
    return max(0, min((num_computed - window + 1) // block_size, num_computed // block_size - 1))
