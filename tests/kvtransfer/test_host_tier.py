"""The host-memory KV tier's file (kvtransfer.host_tier) as plain data: two processes attach to
one tier and read each other's blocks bit for bit; the bound holds (LRU evicts, a load or a put
of a key there makes it recent); a key whose tokens or parent differ is a miss; the BlockManager's
hooks put an evicted block and load it back into a fresh block, registered and whole; and the
pool directory's rules: files 0600 in the 0700 directory (PoolDirError otherwise), a symlink or a
wrong-sized file named as a tier never attached, a dead creator's tier kept while another process
holds it and swept once nobody does, the last user out unlinking it. Each test keeps its files
under a directory of its own ($PDSERVE_SHM_DIR)."""
import fcntl
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from pdserve.common.prefix_hash import ROOT_HASH, chain_hashes
from pdserve.kvtransfer.host_tier import HostTier, TierLink
from pdserve.kvtransfer.pool_files import PoolDirError, pool_dir, sweep_dead_pools
from pdserve.runtime.kv_cache import BlockManager

SHAPE = (2, 2, 4, 2, 8)  # a block: layers, K/V, block_size 4, KV heads, head dim
SLOT = 2 * 2 * 4 * 2 * 8 * 4  # float32 bytes


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def tier_files() -> list[str]:
    return sorted(f for f in os.listdir(pool_dir()) if f.startswith("tier-"))


CHILD = textwrap.dedent("""
    import sys, torch
    from pdserve.kvtransfer.host_tier import HostTier
    shape, slot = (2, 2, 4, 2, 8), 2 * 2 * 4 * 2 * 8 * 4
    t = HostTier.open("m", shape, torch.float32, 4 * slot)
    got = torch.zeros((2, 2, 1, 4, 2, 8))
    assert t.load([(1).to_bytes(16, "little")], bytes(16), [1, 2, 3, 4], got, [0]) == 1
    t.put((2).to_bytes(16, "little"), bytes(16), [5, 6, 7, 8], got[:, :, 0] * 2)
    print(t.path)
    sys.stdout.flush()
    sys.stdin.read()  # holds the tier until told to go
    t.close()
""")


def test_two_processes_share_one_tier_bit_exact(own_shm_dir):
    t = HostTier.open("m", SHAPE, torch.float32, 4 * SLOT)
    b = block(1)
    assert t.put(key(1), ROOT_HASH, [1, 2, 3, 4], b)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout.readline().strip() == t.path  # it attached to this tier, made no other
        pool = torch.zeros((2, 2, 3, 4, 2, 8))
        assert t.load([key(2)], ROOT_HASH, [5, 6, 7, 8], pool, [2]) == 1
        assert torch.equal(pool[:, :, 2], b * 2)  # its put, bit for bit
        assert tier_files() == [os.path.basename(t.path)]
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0
    assert os.path.exists(t.path)  # the child left: this process still holds it
    t.close()
    assert tier_files() == []  # the last one out unlinks it


def test_bound_holds_and_lru_evicts(own_shm_dir):
    t = HostTier.open("m", SHAPE, torch.float32, 3 * SLOT + SLOT // 2)  # 3 slots
    assert t.slots == 3
    for n in range(3):
        t.put(key(n), ROOT_HASH, [n] * 4, block(n))
    assert t.probe([key(0)], ROOT_HASH, [0] * 4) == 1  # 0 made most recent: 1 is the oldest now
    assert not t.put(key(2), ROOT_HASH, [2] * 4, block(2))  # already there: made recent, nothing copied
    t.put(key(3), ROOT_HASH, [3] * 4, block(3))
    assert t.used() == 3
    assert [t.probe([key(n)], ROOT_HASH, [n] * 4) for n in range(4)] == [1, 0, 1, 1]
    pool = torch.zeros((2, 2, 1, 4, 2, 8))
    for n in (0, 2, 3):
        assert t.load([key(n)], ROOT_HASH, [n] * 4, pool, [0]) == 1 and torch.equal(pool[:, :, 0], block(n))
    assert os.path.getsize(t.path) < 3 * SLOT + 2 * 4096 + 3 * 256  # header page, index, 3 slots: bounded
    t.close()


def test_tokens_or_parent_that_differ_are_a_miss(own_shm_dir):
    t = HostTier.open("m", SHAPE, torch.float32, 4 * SLOT)
    t.put(key(1), ROOT_HASH, [1, 2, 3, 4], block(1))
    t.put(key(2), key(1), [5, 6, 7, 8], block(2))
    assert t.probe([key(1), key(2)], ROOT_HASH, [1, 2, 3, 4, 5, 6, 7, 8]) == 2
    assert t.probe([key(1)], ROOT_HASH, [1, 2, 3, 5]) == 0  # one token differs
    assert t.probe([key(2)], key(9), [5, 6, 7, 8]) == 0  # its parent is another block
    assert t.probe([key(1), key(2)], ROOT_HASH, [1, 2, 3, 4, 5, 6, 7, 9]) == 1  # the chain stops at the first miss
    assert t.mismatches == 3
    pool = torch.zeros((2, 2, 2, 4, 2, 8))
    assert t.load([key(1)], ROOT_HASH, [9, 9, 9, 9], pool, [0]) == 0 and not pool.any()  # nothing copied on a miss
    t.close()


def test_block_manager_hooks_put_evicted_blocks_and_load_them_back(own_shm_dir):
    """An evicted registered block goes to the tier; a later match past the local cache loads
    it into a fresh block, registered (a local hit next time), confirmed as `match` confirms."""
    bs = 4
    pool = torch.zeros((2, 2, 4, bs, 2, 8))
    bm = BlockManager(4, bs)
    t = HostTier.open("m", SHAPE, torch.float32, 8 * SLOT)
    link = TierLink(t, pool)
    bm.tier = link
    toks = list(range(100, 112))  # 3 full blocks
    keys = chain_hashes(toks, bs, bm.prefix_key)
    table = bm.allocate(3)
    for k, i in enumerate(table):
        pool[:, :, i] = block(k)
    bm.register(table, keys, 0, toks)
    bm.free_table(table)
    other = bm.allocate(4)  # takes the free block, then evicts all three cached ones into the tier
    assert t.used() == 3 and bm.cached_blocks == 0
    bm.free(other)
    got = bm.match(keys, toks)
    assert len(got) == 3 and bm.cached_blocks == 3
    assert all(torch.equal(pool[:, :, i], block(k)) for k, i in enumerate(got))
    assert link.report()["host_tier_hits"] == 12 and link.report()["host_tier_queries"] == 12
    bm.free(got)
    assert bm.match(keys, toks) == got  # now from the local cache
    assert link.report()["host_tier_queries"] == 12
    bm.free(got)
    wrong = toks[:4] + [0] + toks[5:]  # the second block's tokens differ: only the first is taken
    bm.allocate(4)  # evict again
    bm.free(list(range(4)))
    hit = bm.match(chain_hashes(wrong, bs, bm.prefix_key), wrong)
    assert len(hit) == 1
    bm.free(hit)
    assert bm.free_blocks == bm.num_blocks and bm.leaked() == []
    t.close()


def test_files_follow_the_pool_directory_rules(own_shm_dir):
    t = HostTier.open("m", SHAPE, torch.float32, 2 * SLOT)
    assert stat.S_IMODE(os.stat(pool_dir()).st_mode) == 0o700 and stat.S_IMODE(os.stat(t.path).st_mode) == 0o600
    name = os.path.basename(t.path)
    assert name.startswith(f"tier-{os.getpid()}-")
    other = HostTier.open("another model", SHAPE, torch.float32, 2 * SLOT)  # another fingerprint: a tier of its own
    assert other.path != t.path
    other.close()
    t.close()
    # a symlink or a wrong-sized file named as this fingerprint's tier is never attached: a new tier is made
    fake = os.path.join(pool_dir(), name.replace(f"tier-{os.getpid()}", "tier-1"))
    os.symlink("/etc/passwd", fake)
    garbage = open(os.path.join(pool_dir(), name.replace(f"tier-{os.getpid()}", "tier-2")), "wb")
    garbage.write(b"x" * 8192)
    garbage.flush()
    fcntl.flock(garbage, fcntl.LOCK_SH)  # held, so the sweep leaves it: the attach must refuse it itself
    t = HostTier.open("m", SHAPE, torch.float32, 2 * SLOT)
    assert t.path == os.path.join(pool_dir(), name) and t.slots == 2
    t.close()
    garbage.close()
    os.unlink(fake)
    shutil.rmtree(pool_dir())
    os.mkdir(pool_dir(), 0o755)
    os.chmod(pool_dir(), 0o755)
    with pytest.raises(PoolDirError):
        HostTier.open("m", SHAPE, torch.float32, 2 * SLOT)


HOLD = textwrap.dedent("""
    import os, sys, torch
    from pdserve.kvtransfer.host_tier import HostTier
    t = HostTier.open("m", (2, 2, 4, 2, 8), torch.float32, 4 * 2048)
    print(t.path, flush=True)
    sys.stdin.readline()
    os._exit(9)  # a SIGKILL's effect: nothing unlinks it
""")


def holder():
    """A process that opens the tier (making it, or attaching), prints its path and, told so, dies without closing it."""
    p = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    return p, p.stdout.readline().strip()


def die(p) -> None:
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(timeout=30) == 9


def test_a_dead_creators_tier_is_kept_while_held_and_swept_once_not(own_shm_dir):
    creator, path = holder()
    other, attached = holder()
    assert attached == path
    die(creator)
    assert sweep_dead_pools() == [] and os.path.exists(path)  # its creator is gone but another process holds it
    held = HostTier.open("m", SHAPE, torch.float32, 4 * SLOT)
    assert held.path == path and held.slots == 8  # attached, as its creator sized it
    die(other)
    held.close()  # not its creator, but the last one out: unlinks it
    assert tier_files() == []
    creator, path = holder()
    die(creator)
    assert [p for p, _ in sweep_dead_pools()] == [path] and tier_files() == []  # its creator gone, nobody holding it
