"""The shared-memory KV pool: a pool larger than /dev/shm's free space is refused at creation
(no SIGBUS later), a stale file of the same name (its creator dead) is removed first, and a file
a live creator holds is never touched."""
import os
import subprocess
import sys
import uuid

import pytest
import torch

from pdserve.kvtransfer.pool import SHM_DIR, SHM_PREFIX, KVPool, ShmSpaceError, shm_free_bytes

SHAPE = (2, 2, 4, 8, 2, 8)  # (layers, 2, blocks, block_size, kv heads, head dim)


def name() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def test_a_stale_pool_file_of_the_same_name_is_replaced():
    n = name()
    path = os.path.join(SHM_DIR, SHM_PREFIX + n)
    with open(path, "wb") as f:  # what a killed worker leaves: a file nobody holds
        f.write(b"\xff" * 100)
    pool = KVPool.create(SHAPE, torch.float32, shared=True, name=n)
    try:
        assert pool.path == path and os.path.getsize(path) == pool.nbytes
        assert float(pool.tensor.abs().sum()) == 0.0  # a fresh, zeroed pool
    finally:
        pool.close()
    assert not os.path.exists(path)


def test_a_pool_file_held_by_a_live_creator_is_not_touched():
    n = name()
    code = (f"import torch, sys; from pdserve.kvtransfer.pool import KVPool; p = KVPool.create({SHAPE}, torch.float32, True, {n!r}); "
            "print(p.path, flush=True); sys.stdin.read(); p.close()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = other.stdout.readline().strip()
        assert os.path.exists(path)
        with pytest.raises(ShmSpaceError, match="held by a live process"):
            KVPool.create(SHAPE, torch.float32, shared=True, name=n)
        assert os.path.exists(path)
    finally:
        other.communicate("", timeout=30)
    assert not os.path.exists(path)


def test_a_pool_larger_than_free_shared_memory_is_refused_with_a_clear_message():
    n = name()
    blocks = shm_free_bytes() // (2 * 2 * 8 * 2 * 8 * 4) + 1024  # past the free space: nothing is allocated
    with pytest.raises(ShmSpaceError, match=r"MiB free: lower --kv-cache-mb"):
        KVPool.create((2, 2, blocks, 8, 2, 8), torch.float32, shared=True, name=n)
    assert not os.path.exists(os.path.join(SHM_DIR, SHM_PREFIX + n))
