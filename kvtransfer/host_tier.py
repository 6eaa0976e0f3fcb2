"""The host-memory KV tier: a node-wide, bounded pool of KV blocks in one shared-memory file per
model, where workers put the blocks their prefix cache evicts and from which any worker of that
model on the node (prefill, decode or colocated) loads them instead of recomputing them (issue
41; what Dynamo's KVBM, SGLang's HiCache and LMCache do). Off unless `--kv-host-tier-mb N`.

The file: `tier-<creator pid>-<creator start time>-<fingerprint>` in this user's 0700 pool
directory (kvtransfer.pool_files: the same directory, the same rules as the KV pools), the
fingerprint 16 hex digits of BLAKE2b over the model path, the block shape (layers, 2,
block_size, KV heads, row width) and the dtype, so only workers of one model and KV layout share
one. It holds a header page, an index of slots and the slots' KV: a slot is one block of every
layer, K and V, in the pool's own dtype and layout (quantized pools' rows and scales as they are),
and its index entry the block's prefix-cache key (runtime.kv_cache: 128-bit BLAKE2b chained
keys, keyed with the coordinator's secret), its parent's key (ROOT_HASH for a first block), its
token ids, a valid flag and an LRU stamp. Bounded: N MiB buys floor(N MiB / slot bytes) slots;
a put into a full tier overwrites the least recently used entry (put, found or loaded).

Lifecycle: `HostTier.open` (a worker, after its start-up profile, through `attach`) sweeps the
pools and tiers whose owners are gone, then, holding an flock on the pool directory (so two
workers starting at once make one tier), attaches to the live tier of its fingerprint or creates
it (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, fallocated: a tier /dev/shm cannot hold fails at start,
never with a SIGBUS). Every process that has it open holds a shared flock on it; `close` (at the
worker's exit) unlinks it when no other process holds it (the last one out, under the directory
lock, so no attacher is lost), and a tier whose holders were all SIGKILLed is removed by the next
sweep (pool_files.sweep_dead_pools: its creator gone and nobody holding its flock). Its size is
its creator's --kv-host-tier-mb; a later worker asking another size uses the one there (logged).
An attacher checks the file as a peer's pool is checked (a regular file of this user, not a
symlink, directly in the directory, its header and size those of its fingerprint's layout).

Index updates and slot copies happen under an OFD byte-range lock on the file (fcntl
F_OFD_SETLKW: between processes; a threading lock within one), so a reader never sees a slot
being written; a writer clears the valid flag before it copies and sets it last, so a process
killed mid-copy leaves an empty slot, never a wrong one. A copy is one block (a few KiB to a
few MiB): holding the lock for it keeps the protocol free of pins.

Hooks (BlockManager.tier, runtime.kv_cache): `TierLink.evicting` is called before `allocate`
reuses a registered block and puts that block's KV, key, parent key and tokens into the tier
(a write-back cache: nothing is copied while the block stays cached on the worker). On a lookup
(`BlockManager.match`, so the scheduler's prefix match and a decode worker's grant both use it)
`TierLink.fetch` takes over where the local chain of matched blocks ends: the next keys are
looked up in the tier and confirmed as `match` confirms its own (the entry's tokens equal the
prompt's block, its parent key is the key of the block matched just before, ROOT_HASH for a
first block), copied into freshly allocated local blocks and registered there, so they count as
prefix-cache hits and the prefill starts after them. The link across processes is the parent's
key, not a registration number (those are per process): a false match would need a collision of
the keyed 128-bit BLAKE2b between two prefixes both in the tier, with tokens equal.
Preemption: a preempted sequence's full blocks are registered, so they stay in the worker's
prefix cache and, when their blocks are taken, go to the tier like any evicted block; the
sequence's re-admission matches them locally or loads them from the tier, and recomputes only
what is in neither (its last, partial block at least). Loading is always taken over
recomputing: a 720 KiB block of the default model loads in about 1 ms on a 2-core EPYC (a put
1-3 ms, a first touch of a slot's pages included), where recomputing its 16 tokens there takes
~100 ms. On CUDA the copies are synchronous device-host copies of the pool's blocks (not yet
run on a GPU).

Not built: a disk directory below the tier (blocks the tier evicts are dropped); tensor
parallelism on CUDA (each rank's pool holds a part of the heads; `attach` refuses it).
Counters (this process's, in the heartbeat via runtime.engine.prefix_report, the coordinator's
stats and the gateway's /metrics as pdserve_kv_host_tier_*): tokens looked up in the tier and
found there, blocks and bytes put and loaded, and the tier's used and total slots (node-wide).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import mmap
import os
import stat
import struct
import threading

import numpy as np
import torch

from pdserve.common.errors import NotSupportedError
from pdserve.common.prefix_hash import ROOT_HASH
from pdserve.kvtransfer.pool import ShmSpaceError, shm_free_bytes
from pdserve.kvtransfer.pool_files import TIER_NAME, ensure_pool_dir, entries, start_time, sweep_dead_pools
from pdserve_client.errors import InvalidRequestError

log = logging.getLogger("pdserve.kvtier")

MAGIC = int.from_bytes(b"PDTIER01", "little")
VERSION = 1
PAGE = 4096
# header words (int64): magic, version, slots, block_size, slot_bytes, index_offset, data_offset, clock
H_MAGIC, H_VERSION, H_SLOTS, H_BLOCK, H_SLOT_BYTES, H_INDEX, H_DATA, H_CLOCK = range(8)
HEADER_WORDS = 8
_LOCK = struct.Struct("hhqqi")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)


def index_dtype(block_size: int) -> np.dtype:
    """An index entry: LRU stamp (0: empty), key and parent key (16 bytes each, as 2 uint64), valid flag, token ids."""
    return np.dtype([("stamp", "<u8"), ("key", "<u8", (2,)), ("parent", "<u8", (2,)), ("valid", "<u8"),
                     ("tokens", "<i8", (block_size,))])


def layout(slots: int, block_size: int, slot_bytes: int) -> tuple[int, int, int]:
    """(index offset, data offset, file size) of a tier of `slots` slots."""
    index_at = PAGE
    data_at = -(-(index_at + slots * index_dtype(block_size).itemsize) // PAGE) * PAGE
    return index_at, data_at, data_at + slots * slot_bytes


def fingerprint(model: str | None, block_shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """16 hex digits naming a model's tier: its path and KV block layout."""
    text = f"{os.path.realpath(model) if model else ''}|{tuple(block_shape)}|{dtype}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _words(key: bytes) -> np.ndarray:
    return np.frombuffer(key, "<u8")


class HostTier:
    """One process's mapping of its model's tier file (see the module docstring)."""

    def __init__(self, path: str, fd: int, block_shape: tuple[int, ...], dtype: torch.dtype):
        self.path, self.fd = path, fd  # fd: open for as long as this process uses the tier, flocked shared
        self.block_shape = tuple(block_shape)  # (layers, 2, block_size, KV heads, row width)
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.header = np.frombuffer(self.mm, "<i8", HEADER_WORDS)
        self.slots = int(self.header[H_SLOTS])
        self.slot_bytes = int(self.header[H_SLOT_BYTES])
        self.index = np.frombuffer(self.mm, index_dtype(self.block_shape[2]), self.slots, int(self.header[H_INDEX]))
        numel = math.prod(self.block_shape)
        self.data = torch.frombuffer(self.mm, dtype=dtype, count=self.slots * numel, offset=int(self.header[H_DATA])).view(
            self.slots, *self.block_shape)
        self._thread_lock = threading.Lock()
        self.puts = self.loads = 0  # blocks this process put into the tier / loaded from it
        self.mismatches = 0  # keys found whose entry's tokens or parent differed: a miss

    # ------------------------------------------------------------------ open and close

    @classmethod
    def open(cls, model: str | None, block_shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> HostTier:
        """This node's tier for the model and block layout: the live one, or a new one of nbytes
        (ShmSpaceError if /dev/shm cannot hold it; InvalidRequestError if nbytes holds no block)."""
        block_size = block_shape[2]
        slot_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        slots = nbytes // slot_bytes
        if slots < 1:
            raise InvalidRequestError(f"--kv-host-tier-mb {nbytes / 2**20:g} holds no KV block ({slot_bytes} bytes a block)")
        fp = fingerprint(model, block_shape, dtype)
        sweep_dead_pools()
        directory = ensure_pool_dir()
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)  # one find-or-create at a time (released when dfd closes)
            for entry in entries(directory):
                m = TIER_NAME.fullmatch(entry.name)
                if m and m.group(3) == fp:
                    fd = attach_fd(entry.path, block_size, slot_bytes)
                    if fd is not None:
                        tier = cls(entry.path, fd, block_shape, dtype)
                        if tier.slots != slots:
                            log.info("host KV tier %s: %d slots (%.1f MiB) as its creator made it", entry.path, tier.slots,
                                     tier.slots * slot_bytes / 2**20)
                        return tier
            return cls(*create_file(directory, fp, slots, block_size, slot_bytes), block_shape, dtype)
        finally:
            os.close(dfd)

    def close(self) -> None:
        """Unmap; unlink the file if no other process holds it (the last one out)."""
        if self.fd is None:
            return
        self.header = self.index = self.data = None  # the views go first: an exported buffer cannot be unmapped
        with contextlib.suppress(BufferError):
            self.mm.close()
        directory = os.path.dirname(self.path)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only if no one else holds it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            except BlockingIOError:
                pass
        finally:
            os.close(self.fd)
            self.fd = None
            os.close(dfd)

    # ------------------------------------------------------------------ index

    @contextlib.contextmanager
    def locked(self):
        """The index lock: a threading lock in this process, an OFD lock on the file's first byte between processes."""
        with self._thread_lock:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, _LOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
            try:
                yield
            finally:
                fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _LOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0))

    def _tick(self) -> int:
        self.header[H_CLOCK] += 1
        return int(self.header[H_CLOCK])

    def _find(self, key: bytes) -> int | None:
        k = _words(key)
        ix = self.index
        hit = np.flatnonzero((ix["valid"] == 1) & (ix["key"][:, 0] == k[0]) & (ix["key"][:, 1] == k[1]))
        return int(hit[0]) if len(hit) else None

    def _confirmed(self, key: bytes, parent: bytes, tokens) -> int | None:
        """The slot of key if its entry's parent is `parent` and its tokens are `tokens`, else None."""
        s = self._find(key)
        if s is None:
            return None
        if not (np.array_equal(self.index["parent"][s], _words(parent)) and np.array_equal(self.index["tokens"][s], tokens)):
            self.mismatches += 1
            return None
        return s

    def put(self, key: bytes, parent: bytes, tokens: list[int], block: torch.Tensor) -> bool:
        """Copy one block's KV (block_shape) in under key; False if the key is there already (made most recent)."""
        with self.locked():
            s = self._find(key)
            if s is not None:
                self.index["stamp"][s] = self._tick()
                return False
            s = int(np.argmin(self.index["stamp"]))  # an empty slot (stamp 0), else the least recently used
            self.index["valid"][s] = 0  # killed mid-copy: an empty slot, never a wrong one
            self.index["stamp"][s] = 0
            self.data[s].copy_(block)
            self.index["key"][s] = _words(key)
            self.index["parent"][s] = _words(parent)
            self.index["tokens"][s] = tokens
            self.index["stamp"][s] = self._tick()
            self.index["valid"][s] = 1
            self.puts += 1
            return True

    def probe(self, keys: list[bytes], parent: bytes, tokens: list[int]) -> int:
        """How many of keys (a chain after `parent`; tokens: theirs, block after block) the tier
        holds confirmed, from the first on; those found are made most recent."""
        bs = self.block_shape[2]
        n = 0
        with self.locked():
            for k, key in enumerate(keys):
                s = self._confirmed(key, parent, tokens[k * bs:(k + 1) * bs])
                if s is None:
                    break
                self.index["stamp"][s] = self._tick()
                parent, n = key, n + 1
        return n

    def load(self, keys: list[bytes], parent: bytes, tokens: list[int], pool: torch.Tensor, ids: list[int]) -> int:
        """Copy the confirmed entries of keys (as `probe`) into pool's blocks ids, in order; how many were."""
        bs = self.block_shape[2]
        n = 0
        with self.locked():
            for k, (key, i) in enumerate(zip(keys, ids)):
                s = self._confirmed(key, parent, tokens[k * bs:(k + 1) * bs])
                if s is None:
                    break
                pool[:, :, i].copy_(self.data[s])
                self.index["stamp"][s] = self._tick()
                parent, n = key, n + 1
        self.loads += n
        return n

    def used(self) -> int:
        """Slots holding a block now (read without the lock: a heartbeat's approximate count)."""
        return int((self.index["valid"] == 1).sum()) if self.index is not None else 0


def create_file(directory: str, fp: str, slots: int, block_size: int, slot_bytes: int) -> tuple[str, int]:
    """A new tier file (path, fd flocked shared) with its header written; the caller holds the directory lock."""
    pid = os.getpid()
    path = os.path.join(directory, f"tier-{pid}-{start_time(pid) or 0}-{fp}")
    index_at, data_at, size = layout(slots, block_size, slot_bytes)
    if size > shm_free_bytes(directory):
        raise ShmSpaceError(f"the host KV tier needs {size / 2**20:.1f} MiB of shared memory but {directory} has "
                            f"{shm_free_bytes(directory) / 2**20:.1f} MiB free: lower --kv-host-tier-mb")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process uses it: proof of life for the sweep
        os.posix_fallocate(fd, 0, size)
        header = [MAGIC, VERSION, slots, block_size, slot_bytes, index_at, data_at, 0]
        os.pwrite(fd, np.array(header, "<i8").tobytes(), 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    log.info("host KV tier %s: %d blocks (%.1f MiB)", path, slots, size / 2**20)
    return path, fd


def attach_fd(path: str, block_size: int, slot_bytes: int) -> int | None:
    """An fd of the tier at path, flocked shared, if it is a live tier of this layout: a regular file
    of this user (opened O_NOFOLLOW), not unlinked, its header and size agreeing; else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < PAGE:
            raise ValueError("not a tier of ours")
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a sweep holding it exclusively is removing it
        if os.fstat(fd).st_nlink == 0:
            raise ValueError("removed meanwhile")
        h = np.frombuffer(os.pread(fd, HEADER_WORDS * 8, 0), "<i8")
        index_at, data_at, size = layout(int(h[H_SLOTS]), block_size, slot_bytes)
        if (int(h[H_MAGIC]), int(h[H_VERSION]), int(h[H_BLOCK]), int(h[H_SLOT_BYTES]), int(h[H_INDEX]), int(h[H_DATA]),
                st.st_size) != (MAGIC, VERSION, block_size, slot_bytes, index_at, data_at, size) or h[H_SLOTS] < 1:
            raise ValueError("header disagrees")
    except (OSError, ValueError) as e:
        log.warning("not attaching the host KV tier %s: %s", path, e)
        os.close(fd)
        return None
    return fd


class TierLink:
    """A BlockManager's hooks into a HostTier (BlockManager.tier; see the module docstring)."""

    def __init__(self, tier: HostTier, pool: torch.Tensor):
        self.tier = tier
        self.pool = pool  # the engine's KV pool: (layers, 2, num_blocks, block_size, KV heads, row width)
        self.queries = 0  # tokens of full blocks past the local cache's hit looked up in the tier
        self.hits = 0  # of those, tokens loaded from it

    def evicting(self, blocks, i: int) -> None:
        """Registered block i is about to be reused: its KV goes to the tier (an I/O error loses it, logged: a miss later)."""
        try:
            self.tier.put(blocks.hash_of[i], blocks.parent_key_of[i], blocks.tokens_of[i], self.pool[:, :, i])
        except OSError as e:
            log.warning("host KV tier %s: a block not put: %s", self.tier.path, e)

    def fetch(self, blocks, hashes: list[bytes], tokens: list[int], ids: list[int]) -> list[int]:
        """Local blocks (count 1, registered) holding the tier's KV of hashes' blocks after the
        matched `ids`, in order, as many as the tier holds confirmed and the pool has free."""
        m, bs = len(ids), blocks.block_size
        parent, keys, rest = (hashes[m - 1] if m else ROOT_HASH), hashes[m:], tokens[m * bs:]
        self.queries += len(keys) * bs
        n = min(self.tier.probe(keys, parent, rest), blocks.free_blocks)
        if not n:
            return []
        new = blocks.allocate(n)  # may evict cached blocks into the tier: after the probe made ours most recent
        try:
            got = self.tier.load(keys[:n], parent, rest, self.pool, new)
        except OSError as e:
            log.warning("host KV tier %s: nothing loaded: %s", self.tier.path, e)
            got = 0
        blocks.free(new[got:])  # entries overwritten between probe and load (another worker's puts), or not read: never registered
        new = new[:got]
        blocks.register(ids + new, hashes[:m + got], m, rest[:got * bs])
        self.hits += got * bs
        return new

    def report(self) -> dict:
        """The heartbeat's host-tier fields (wire.protocol.Heartbeat)."""
        b = self.tier.slot_bytes
        return {"host_tier_queries": self.queries, "host_tier_hits": self.hits, "host_tier_bytes_in": self.tier.puts * b,
                "host_tier_bytes_out": self.tier.loads * b, "host_tier_blocks": self.tier.used(),
                "host_tier_capacity": self.tier.slots}


def attach(engine, cfg, model: str | None) -> HostTier | None:
    """Hook engine's block manager to this node's tier for its model (cfg: its EngineConfig,
    --kv-host-tier-mb); None when the tier is off. Call after the start-up profile, whose random
    prompts are no one's prefix. The caller closes the tier at exit."""
    if not cfg.kv_host_tier_bytes:
        return None
    if not cfg.prefix_cache:
        raise InvalidRequestError("--kv-host-tier-mb keeps the prefix cache's evicted blocks: it needs the prefix cache (drop --no-prefix-cache)")
    if cfg.tensor_parallel_size > 1 and not cfg.device.startswith("cpu"):
        raise NotSupportedError("--kv-host-tier-mb with tensor parallelism on CUDA is not supported (each rank's pool holds a part of the KV heads)")
    pool = engine.runner.kv_cache
    shape = tuple(pool.shape)
    tier = HostTier.open(model, (*shape[:2], *shape[3:]), pool.dtype, cfg.kv_host_tier_bytes)
    engine.blocks.tier = TierLink(tier, pool)
    return tier
