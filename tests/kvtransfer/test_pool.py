"""The shared-memory KV pool: it lives in this user's 0700 pool directory under a random name
that records its owner (pid and start time); a pool larger than /dev/shm's free space is refused
at creation (no SIGBUS later); the sweep removes the pools whose owners are gone (killed, or a
reused pid) and never one whose owner lives (seen by pid, or only by its flock), and the pools an
earlier pdserve left directly in /dev/shm likewise; a pool directory that is a symlink or not this
user's 0700 directory is refused."""
import fcntl
import math
import os
import secrets
import signal
import stat
import subprocess
import sys

import pytest
import torch

from pdserve.common.shm import SHM_DIR_ENV
from pdserve.kvtransfer import pool_files
from pdserve.kvtransfer.pool import KVPool, ShmSpaceError, shm_free_bytes
from pdserve.kvtransfer.pool_files import PoolDirError, ensure_pool_dir, owner_of, pool_dir, start_time, sweep_dead_pools
from tests.helpers import pools_of

SHAPE = (2, 2, 4, 8, 2, 8)  # (layers, 2, blocks, block_size, kv heads, head dim)
NBYTES = math.prod(SHAPE) * 4
HOLD = (f"import torch, sys; from pdserve.kvtransfer.pool import KVPool; p = KVPool.create({SHAPE}, torch.float32, True); "
        "print(p.path, flush=True); sys.stdin.read(); p.close()")


def test_a_shared_pool_lives_in_the_users_0700_directory_under_a_random_name_of_its_owner():
    pools = [KVPool.create(SHAPE, torch.float32, shared=True) for _ in range(2)]
    try:
        d = os.lstat(pool_dir())
        assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.geteuid()
        for p in pools:
            assert os.path.dirname(p.path) == pool_dir() and owner_of(os.path.basename(p.path)) == (os.getpid(), start_time(os.getpid()))
            st = os.lstat(p.path)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == p.nbytes
            assert float(p.tensor.abs().sum()) == 0.0  # a fresh, zeroed pool
        assert pools[0].path != pools[1].path
        assert sweep_dead_pools(os.getpid()) == [] and all(os.path.exists(p.path) for p in pools)  # a live owner's pools stay
    finally:
        for p in pools:
            p.close()
    assert not any(os.path.exists(p.path) for p in pools)


def test_the_pool_of_a_killed_owner_is_swept_and_a_live_owners_is_not():
    dead, live = (subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2))
    try:
        dead_path, live_path = dead.stdout.readline().strip(), live.stdout.readline().strip()
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert os.path.exists(dead_path)  # nothing unlinks it on a SIGKILL: the sweep must
        removed = sweep_dead_pools()
        assert (dead_path, NBYTES) in removed and not os.path.exists(dead_path)
        assert live_path not in dict(removed) and os.path.exists(live_path)
    finally:
        live.communicate("", timeout=30)
    assert not os.path.exists(live_path)


def test_a_reused_pid_does_not_keep_a_dead_owners_pool_but_a_held_flock_does():
    directory = ensure_pool_dir()
    me = os.getpid()
    reused = os.path.join(directory, f"kv-{me}-{start_time(me) + 1}-{secrets.token_hex(8)}")  # our pid, another start time
    mine = os.path.join(directory, f"kv-{me}-{start_time(me)}-{secrets.token_hex(8)}")
    hidden = os.path.join(directory, f"kv-{2**22 + 7}-1-{secrets.token_hex(8)}")  # no such pid here: an owner in another pid namespace
    for path in (reused, mine, hidden):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    held = os.open(hidden, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        removed = dict(sweep_dead_pools())
        assert reused in removed and not os.path.exists(reused)
        assert mine not in removed and os.path.exists(mine)
        assert hidden not in removed and os.path.exists(hidden)
    finally:
        os.close(held)
        for path in (mine, hidden):
            os.unlink(path)


def test_a_pool_directory_that_is_a_symlink_or_not_a_0700_directory_of_ours_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, pool_dir())
    with pytest.raises(PoolDirError, match="a symlink"):
        KVPool.create(SHAPE, torch.float32, shared=True)
    assert os.listdir(target) == [] and sweep_dead_pools() == []
    os.unlink(pool_dir())
    os.mkdir(pool_dir(), 0o700)
    os.chmod(pool_dir(), 0o777)
    with pytest.raises(PoolDirError, match="mode 777"):
        KVPool.create(SHAPE, torch.float32, shared=True)
    assert os.listdir(pool_dir()) == []
    if os.geteuid() == 0:  # root can give it to another user: a squatter's directory
        os.chmod(pool_dir(), 0o700)
        os.chown(pool_dir(), 65534, 65534)
        with pytest.raises(PoolDirError, match="of uid 65534"):
            KVPool.create(SHAPE, torch.float32, shared=True)
        assert os.listdir(pool_dir()) == []


def test_a_pool_larger_than_free_shared_memory_is_refused_with_a_clear_message():
    blocks = shm_free_bytes() // (2 * 2 * 8 * 2 * 8 * 4) + 1024  # past the free space: nothing is allocated
    with pytest.raises(ShmSpaceError, match=r"MiB free: lower --kv-cache-mb"):
        KVPool.create((2, 2, blocks, 8, 2, 8), torch.float32, shared=True)
    assert pools_of(os.getpid()) == []


def test_pools_an_earlier_pdserve_left_in_dev_shm_are_swept_when_their_owner_is_gone():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    dead, live = (os.path.join(pool_files.SHM_DIR, f"pdserve-kv-{pid}") for pid in (gone, os.getpid()))
    others = os.path.join(pool_files.SHM_DIR, f"pdserve-kv-{int(gone) + 2**22}")  # no such pid either, but another user's file
    paths = (dead, live, others) if os.geteuid() == 0 else (dead, live)  # (only root can make another user's file)
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    if others in paths:
        os.chown(others, 65534, 65534)
    try:
        removed = dict(sweep_dead_pools())
        assert removed.get(dead) == 64 and not os.path.exists(dead)
        assert live not in removed and os.path.exists(live)
        assert all(os.path.exists(p) for p in paths[2:])
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
