"""The paged KV cache: one tensor of pages and the block manager that hands them out.

Lifecycle: a worker allocates the pool once (`allocate_kv_cache`, optionally over a buffer it
shares with other processes) and builds one `BlockManager` over its block ids. The pool's dtype
is the model's, or with --kv-cache-dtype int8 / fp8 (EngineConfig.kv_torch_dtype) uint8 /
float8_e4m3fn rows of D codes + 4 bytes of scale (and int8's zero code) (kernels.kv_quant): D + 4
bytes a (token, head) instead of 4 D, so the same --kv-cache-mb holds 3.76x the blocks at D = 64. Sequences grow
their block tables through `BlockManager.ensure_slots`, which answers False, never raises, when
the pool is short, so the scheduler can preempt; `free_table` gives every block back. Ref counts
let a block be shared (a forked or prefix-shared sequence); a block returns to the pool when its
count reaches zero. At shutdown `free_blocks == num_blocks` is the leak check.

Prefix cache (on unless `prefix_cache=False`): a full block whose KV is computed is registered
under a key of its tokens chained to the previous block's key (runtime.prefix_hash, keyed with
`prefix_key`; `register`), keeping its token ids and its parent: the registration number of the
block before it (0 for a first block). When its count reaches zero a registered block is not
wiped but kept, evictable, in LRU order; `match` hands the registered blocks of a token prefix to
a new sequence (count + 1) so its prefill starts after them. A key alone never hands out a block:
`match` takes a block only if its tokens equal the prefix's and its parent is the block matched
just before, so every matched block's KV was computed from exactly that prefix even if keys
collide; a key whose block fails that is a miss, counted in `mismatches`. A block whose key is
already held by another (the same prefix computed twice at once) stays unregistered but linked
to that equal block, so its sequence's later blocks still register; a block that cannot be linked
(a colliding key) ends its sequence's registrations. `allocate` takes never-registered blocks
first, then evicts the least recently freed cached ones, so cached blocks count as free. A
block's key and tokens stay with it until it is evicted; a block is only ever written while it is
unregistered (it is registered once full, and shared blocks are full), so sharing needs no copy.
`set_prefix_key` (a worker's coordinator's Welcome: a new coordinator, a new secret) forgets every
registration. `changes` records key changes since the last `take_changes` (the worker's heartbeat
reports them, bounded). A host-memory KV tier (`tier`, kvtransfer.host_tier) hooks in at two
points: `allocate` hands it each registered block before reusing it, and `match` lets it extend
a match past the last cached block (confirmed there as here, then registered here).

Sliding windows (`window` > 0: ModelConfig.kv_window, a model whose every layer slides, e.g.
Mistral with `sliding_window`, Qwen3-MoE with `use_sliding_window`): a query at position p reads
keys p - window < k <= p only, so a block wholly before the window of a sequence's next position
is never read again by any layer. `drop_outside_window` (the engine calls it after each step and
when a sequence joins: prefix match, hand-off) frees such blocks and leaves NULL_BLOCK in their
table entries, so positions keep their indices; attention never reads an entry before the
window (the C decode kernel starts at the window, kernels.torch_paged gathers from the window's
first block, Triton masks its first tile; ModelRunner maps NULL_BLOCK to block 0 in the tensors it
hands them, so even a masked load stays in the pool). `first_needed` says where the window
starts; it also keeps the block before the one being filled, whose registration link chains the
next block's key (a window shorter than a block would otherwise free it first). A freed
registered block joins the evictable cache like any other: its KV is that of its whole prefix,
so `match` may still hand it to a prompt whose chain it ends (a chain is matched from block 0, so
once an early block is evicted the blocks after it are unreachable); a table with a NULL_BLOCK
registers nothing from there on. `window_freed` counts the blocks freed this way; `held(table)`
the blocks a table holds.

KV groups (`group_windows`, ModelConfig.kv_groups: a model whose sliding layers sit beside
full-attention ones, Gemma 2 / 3, Qwen2's layer_types; runtime.kv_groups): the layers are split
into groups of one window each, a pool block holds one group's layers, and a sequence holds one
table per group (`Sequence.block_tables`, every table as long as the others), all drawn from the
one free list. The plural calls take a sequence's tables: `ensure_tables` grows all of them or
none, `drop_outside_windows` frees each sliding group's blocks before its own window (the full
group keeps all), `free_tables` frees them all, `held_by` counts them; a single-group manager
(every model whose layers attend alike: `groups == 1`) runs the same calls on its one table, so
its behaviour is the single table's above. A hand-off carries a sequence's tables as one list,
position by position and group by group within a position (`interleave` / `deinterleave`).
The prefix cache is off for a multi-group manager (`prefix_cache` False whatever was asked):
keys, `match` and `register` are per block of one table, and a group-aware match (every group's
blocks of a prefix present, a sliding group's only within its window) is not built.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

import torch

from pdserve.common.kv_window import first_needed_block
from pdserve.common.prefix_hash import ROOT_HASH, chain_hashes, new_secret
from pdserve.kernels import kv_quant
from pdserve.runtime.config import ModelConfig


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """(layers, 2, num_blocks, block_size, KVH, W): W = D, or for a quantized pool (uint8, float8_e4m3fn:
    --kv-cache-dtype int8 / fp8) D codes + 4 metadata bytes (a scale, int8's zero code) per (token, head) row (kernels.kv_quant).
    `layers` is one KV group's (cfg.kv_groups.size): every layer's unless sliding and full ones mix."""
    return (cfg.kv_groups.size, 2, num_blocks, block_size, cfg.num_kv_heads, kv_quant.row_width(cfg.head_dim, dtype))


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    # zeros so an unwritten page is harmless if read (a quantized row of zeros: codes 0, scale 0, zero code 0)
    return torch.zeros(kv_cache_shape(cfg, num_blocks, block_size, dtype), dtype=dtype, device=device)


NULL_BLOCK = -1  # a table entry whose block was freed (before the sliding window): holds nothing, never read
MAX_CHANGES = 4096  # key additions/evictions kept for the next heartbeat; beyond this the oldest are dropped


def interleave(tables: list[list[int]]) -> list[int]:
    """A sequence's per-group tables (all of one length) as one list, position-major: entry
    k * groups + g is group g's block k (a hand-off's grant and send order). One table: itself."""
    if len(tables) == 1:
        return tables[0]
    return [b for row in zip(*tables, strict=True) for b in row]


def deinterleave(flat: list[int], groups: int) -> list[list[int]]:
    """`interleave`'s inverse: groups tables of len(flat) / groups entries each (one group: [flat])."""
    if groups == 1:
        return [flat]
    if len(flat) % groups:
        raise ValueError(f"{len(flat)} block ids do not split into {groups} KV groups' tables")
    return [flat[g::groups] for g in range(groups)]


class BlockManager:
    NULL = NULL_BLOCK  # for those that may not import this module (decode/grants.py)
    interleave = staticmethod(interleave)  # likewise

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True, prefix_key: bytes | None = None, window: int = 0,
                 group_windows: tuple[int, ...] = ()):
        if len(group_windows) > 1 and window:
            raise ValueError("a KV-group manager takes each group's window (group_windows), not one window for every layer")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # every layer's sliding window in keys (the widest), 0 if any layer attends in full
        self.group_windows = tuple(group_windows) if len(group_windows) > 1 else (window,)  # each KV group's window (0: full)
        self.groups = len(self.group_windows)  # block tables a sequence holds: one per KV group
        self.window_freed = 0  # blocks freed because they fell wholly before their sequence's window
        self.prefix_cache = prefix_cache and self.groups == 1  # not built for KV groups (module docstring)
        self.prefix_key = prefix_key or new_secret()  # the secret block keys are made with (set_prefix_key)
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))  # count 0, holding nothing
        self.cached: OrderedDict[int, None] = OrderedDict()  # count 0, registered: evictable, least recently freed first
        self.hash_of: list[bytes | None] = [None] * num_blocks  # a registered block's key
        self.tokens_of: list[list[int] | None] = [None] * num_blocks  # and its token ids
        self.parent_of = [0] * num_blocks  # and the registration number of the block before it (0: a first block)
        self.link_of = [0] * num_blocks  # the registration number of the block whose KV equals this one's (0: none)
        self.registrations = 0  # registration numbers handed out (never reused)
        self.by_hash: dict[bytes, int] = {}  # key -> the block registered under it
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)
        self.mismatches = 0  # keys found whose block's tokens or parent differed: a miss (a key collision)
        self.changes: OrderedDict[bytes, bool] = OrderedDict()  # key -> registered (True) or evicted, since take_changes
        self._changes_lock = threading.Lock()  # take_changes runs on a worker's heartbeat (I/O) thread
        # host KV tier hooks (kvtransfer.host_tier.TierLink; None: off): tier.evicting(self, i) before a
        # registered block is reused, tier.fetch(self, hashes, tokens, ids) -> more blocks where a match ends
        self.tier = None
        self.parent_key_of: list[bytes] = [ROOT_HASH] * num_blocks  # a registered block's parent's key (the tier's link)

    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation can take: never-registered ones and evictable cached ones."""
        return len(self.free_ids) + len(self.cached)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self.by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (nothing taken) when fewer are free."""
        if n > self.free_blocks:
            return None
        ids = []
        for _ in range(n):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:
                i, _ = self.cached.popitem(last=False)
                if self.tier is not None:
                    self.tier.evicting(self, i)
                self._unregister(i)
            self.ref_counts[i] = 1
            ids.append(i)
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} is free and cannot be shared")
            self.ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each of ids (NULL_BLOCK entries hold nothing and are skipped)."""
        for i in ids:
            if i == NULL_BLOCK:
                continue
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                if self.hash_of[i] is not None:
                    self.cached[i] = None  # most recently freed: evicted last
                else:
                    self.link_of[i] = 0
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
        self.free(block_table[::-1])  # a sequence's last blocks are the least likely to be asked for again: evicted first
        block_table.clear()

    # ------------------------------------------------------------------ a sequence's tables (one per KV group)

    def new_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.groups)]

    def ensure_tables(self, tables: list[list[int]], num_tokens: int) -> bool:
        """Grow every group's table (in place) to hold num_tokens tokens; False (nothing taken) if the pool is short."""
        if self.groups == 1:
            return self.ensure_slots(tables[0], num_tokens)
        if len(tables) != self.groups:
            raise ValueError(f"{len(tables)} block tables for {self.groups} KV groups")
        want = self.blocks_for(num_tokens)
        ids = self.allocate(sum(max(0, want - len(t)) for t in tables))
        if ids is None:
            return False
        for t in tables:
            n = max(0, want - len(t))
            t.extend(ids[:n])
            del ids[:n]
        return True

    def free_tables(self, tables: list[list[int]]) -> None:
        for t in tables:
            self.free_table(t)

    @staticmethod
    def held_by(tables: list[list[int]]) -> int:
        """Blocks a sequence's tables hold, all groups together."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in tables)

    def table_blocks(self, num_tokens: int, chunk: int | None = None) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once while it is computed in
        steps of at most `chunk` tokens (None: all in one step): every group's table whole, but a
        sliding group's (KV groups) only its window and one step's blocks (it frees the older
        ones after each step: from first_needed on, at most (chunk + window - 3) // block_size + 2,
        or (chunk - 2) // block_size + 3 where the block before the one being filled is kept)."""
        n = self.blocks_for(num_tokens)
        if self.groups == 1 or chunk is None:
            return self.groups * n
        bs = self.block_size
        return sum(min(n, max((chunk + w - 3) // bs + 2, (chunk - 2) // bs + 3)) if w else n for w in self.group_windows)

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    @staticmethod
    def held(block_table: list[int]) -> int:
        """Blocks the table holds (its NULL_BLOCK entries were freed)."""
        return len(block_table) - block_table.count(NULL_BLOCK)

    # ------------------------------------------------------------------ sliding window

    def first_needed(self, num_computed: int) -> int:
        """The index of the first block a sequence with num_computed tokens computed reads again
        (common.kv_window; 0 without a window): those before lie wholly outside every layer's
        window, the block before the one being filled excepted (its link chains the next key)."""
        return first_needed_block(num_computed, self.window, self.block_size)

    def first_needed_by_group(self, num_computed: int) -> tuple[int, ...]:
        """`first_needed` for each KV group's table (a full group's: 0)."""
        if self.groups == 1:
            return (self.first_needed(num_computed),)
        return tuple(first_needed_block(num_computed, w, self.block_size) for w in self.group_windows)

    def drop_outside_windows(self, tables: list[list[int]], num_computed: int) -> int:
        """`drop_outside_window` for each sliding group's table of a sequence; returns how many blocks were freed."""
        if self.groups == 1:
            return self.drop_outside_window(tables[0], num_computed)
        return sum(self.drop_outside_window(t, num_computed, w) for t, w in zip(tables, self.group_windows, strict=True) if w)

    def drop_outside_window(self, block_table: list[int], num_computed: int, window: int | None = None) -> int:
        """Free the blocks of block_table (in place: NULL_BLOCK in their entries) that lie wholly
        before the window (`window`, else every layer's) of a sequence with num_computed tokens
        computed; returns how many. Entries before the window are a run of NULL_BLOCK then held
        blocks (the run only grows), so the walk goes back from the window's start to the first NULL_BLOCK."""
        window = self.window if window is None else window
        if not window:
            return 0
        k = first_needed_block(num_computed, window, self.block_size) - 1
        dropped = []
        while k >= 0 and block_table[k] != NULL_BLOCK:
            dropped.append(block_table[k])
            block_table[k] = NULL_BLOCK
            k -= 1
        self.free(dropped[::-1])  # oldest first: evicted first
        self.window_freed += len(dropped)
        return len(dropped)

    # ------------------------------------------------------------------ prefix cache

    def match(self, hashes: list[bytes], tokens: list[int]) -> list[int]:
        """The registered blocks of the longest prefix of `hashes` (chained block keys of
        `tokens`' blocks) whose tokens and parents are confirmed, each taken (count + 1: a cached
        one leaves the evictable set). The caller counts the lookup (`count_lookup`) once it
        keeps the match."""
        ids = []
        if not self.prefix_cache:
            return ids
        bs = self.block_size
        for k, h in enumerate(hashes):
            i = self.by_hash.get(h)
            if i is None:
                break
            if self.parent_of[i] != (self.link_of[ids[-1]] if ids else 0) or self.tokens_of[i] != tokens[k * bs:(k + 1) * bs]:
                self.mismatches += 1
                break
            if self.ref_counts[i] == 0:
                del self.cached[i]
            self.ref_counts[i] += 1
            ids.append(i)
        if self.tier is not None and len(ids) < len(hashes):
            ids += self.tier.fetch(self, hashes, tokens, ids)
        return ids

    def match_tokens(self, tokens: list[int], upto_blocks: int, salt: str | None = None) -> list[int]:
        """`match` for the full blocks of tokens (at most upto_blocks), keyed here from salt's root."""
        if not self.prefix_cache:
            return []
        return self.match(chain_hashes(tokens, self.block_size, self.prefix_key, upto_blocks, salt=salt), tokens)

    def count_lookup(self, tokens_queried: int, tokens_hit: int) -> None:
        self.queries += tokens_queried
        self.hits += tokens_hit

    def register(self, block_table: list[int], hashes: list[bytes], first: int, tokens: list[int]) -> None:
        """Register block_table[k] under hashes[k] for k from first on (their KV is computed;
        `tokens` are theirs, from block first on; the blocks before first were registered or
        linked by earlier calls). A key already held by an equal block (same tokens, same parent)
        links this block to it; one held by a different block ends the registrations, as does
        a block before first that is linked to nothing."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        if first and block_table[first - 1] == NULL_BLOCK:
            return  # the block before was freed (outside the window): its link is not ours to read
        parent = self.link_of[block_table[first - 1]] if first else 0
        for k in range(first, len(hashes)):
            i, h, t = block_table[k], hashes[k], tokens[(k - first) * bs:(k - first + 1) * bs]
            if (k and not parent) or i == NULL_BLOCK:
                return  # its prefix's KV is linked to no registered block (or is not held): never matchable
            if self.hash_of[i] is None:
                j = self.by_hash.get(h)
                if j is None:
                    self.registrations += 1
                    self.hash_of[i], self.tokens_of[i], self.parent_of[i], self.link_of[i] = h, t, parent, self.registrations
                    self.parent_key_of[i] = hashes[k - 1] if k else ROOT_HASH
                    self.by_hash[h] = i
                    self._note(h, True)
                elif self.parent_of[j] == parent and self.tokens_of[j] == t:
                    self.link_of[i] = self.link_of[j]  # the same prefix computed twice at once
                else:
                    self.mismatches += 1
                    return
            parent = self.link_of[i]

    def set_prefix_key(self, key: bytes) -> None:
        """Key blocks with `key` from now on; a new key forgets every registration (blocks held
        stay held, unregistered), so no key made with the old one can match."""
        if key == self.prefix_key:
            return
        self.prefix_key = key
        for i in list(self.by_hash.values()):
            self._unregister(i)
        while self.cached:
            self.free_ids.append(self.cached.popitem(last=False)[0])
        self.link_of = [0] * self.num_blocks
        self.take_changes()

    def _unregister(self, i: int) -> None:
        h = self.hash_of[i]
        if h is not None:
            self.hash_of[i] = self.tokens_of[i] = None
            self.link_of[i] = 0
            del self.by_hash[h]
            self._note(h, False)

    def _note(self, h: bytes, registered: bool) -> None:
        with self._changes_lock:
            self.changes[h] = registered
            self.changes.move_to_end(h)
            if len(self.changes) > MAX_CHANGES:
                self.changes.popitem(last=False)  # the view is approximate: a lost change costs a misplaced request, never a wrong token

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys registered, keys evicted) since the last call, each key's last change only."""
        with self._changes_lock:
            changes, self.changes = self.changes, OrderedDict()
        return [h for h, r in changes.items() if r], [h for h, r in changes.items() if not r]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds, the counters and the changes (after
        a worker's start-up profile, whose random prompts are no one's prefix)."""
        while self.cached:
            i, _ = self.cached.popitem(last=False)
            self._unregister(i)
            self.free_ids.append(i)
        self.queries = self.hits = 0
        self.take_changes()

    def leaked(self) -> list[int]:
        """Blocks still referenced (for the end-of-test check: every count zero)."""
        return [i for i, c in enumerate(self.ref_counts) if c]
