"""KV groups: how a model's layers share the paged KV pool when some slide and some attend in
full (Gemma 2: every other layer slides; Gemma 3: five of each six; Qwen2 with layer_types).

The layers are split into groups of `size` layers each (the fewest layers of any one window,
vLLM's hybrid KV cache rule), every group's layers of one window (0: full attention); a window
whose layer count is not a multiple of `size` gets a last, shorter group, whose pool slots past
its layers go unused. The pool is (size, 2, num_blocks, block_size, KVH, W): a block id holds
`size` layers' pages, and each sequence holds one block table per group, so that a sliding
group's blocks before its window can be freed while the full group keeps all of its own. Layer l
writes and reads pool[slot_of[l]] through the table of group group_of[l]. A model whose layers
all attend alike (every one full, or every one through one window) has one group of all its
layers: the pool and the single block table of before.

Lifecycle: `kv_groups(layer_windows, num_layers)` is computed once per ModelConfig
(ModelConfig.kv_groups) and read by the pool's shape, the block manager, the runner and the
layers; it never changes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]  # each group's layers, in order
    windows: tuple[int, ...]  # each group's sliding window in keys (0: full attention)
    size: int  # pool slots a block holds: the longest group's layer count
    group_of: tuple[int, ...]  # layer -> its group
    slot_of: tuple[int, ...]  # layer -> its index within its group: its slot of the pool

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def split(self) -> bool:
        """Whether there is more than one group (mixed windows: one block table per group)."""
        return len(self.layers) > 1


def kv_groups(layer_windows: tuple[int, ...], num_layers: int) -> KVGroups:
    """The KV groups of a model whose layer l attends through layer_windows[l] keys (0 or an empty
    tuple: full attention). One group of every layer when all windows are equal."""
    windows = layer_windows or (0,) * num_layers
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w, []).append(layer)
    size = min(len(ls) for ls in by_window.values())
    if len(by_window) == 1:
        size = num_layers
    groups = [(w, tuple(ls[i:i + size])) for w, ls in sorted(by_window.items()) for i in range(0, len(ls), size)]
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, (_, ls) in enumerate(groups):
        for j, layer in enumerate(ls):
            group_of[layer], slot_of[layer] = g, j
    return KVGroups(tuple(ls for _, ls in groups), tuple(w for w, _ in groups), size, tuple(group_of), tuple(slot_of))
