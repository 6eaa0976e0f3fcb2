"""A pool path a peer names (a decode worker's KVAccept.shm_path, a TP rank's RankSpec.pool_path)
is mapped only if it is canonical and names a regular file of this user, of the expected size,
directly in this user's 0700 pool directory: a path through `..`, a symlink (even one named like a
pool, even to a real pool), a file elsewhere or of another size is refused with PoolRefused and
nothing is mapped; through a real KVSender the hand-off fails typed and the sender keeps no mapping."""
import os
import queue
import secrets
import threading

import pytest
import torch
import zmq

from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.pool_files import PoolRefused, pool_dir, start_time
from pdserve.kvtransfer.transfer import KVReceiver, KVSender
from pdserve.wire.protocol import KVReady
from pdserve_client.params import SamplingParams

SHAPE = (2, 2, 4, 8, 2, 8)  # (layers, 2, blocks, block_size, kv heads, head dim)
NBYTES = 2 * 2 * 4 * 8 * 2 * 8 * 4


def mapped(path: str) -> bool:
    """Whether this process maps the file at path."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith((f" {real}", f" {real} (deleted)")) for line in f)


@pytest.fixture
def pool():
    p = KVPool.create(SHAPE, torch.float32, shared=True)
    yield p
    p.close()


@pytest.fixture
def other():
    """A file of the pool's size outside the pool directory, next to it in /dev/shm: what a `..` reaches."""
    path = os.path.join(os.path.dirname(pool_dir()), f"pdserve-test-other-{secrets.token_hex(6)}")
    with open(path, "wb") as f:
        f.write(b"\x01" * NBYTES)
    yield path
    os.unlink(path)


def pool_name() -> str:
    return f"kv-{os.getpid()}-{start_time(os.getpid())}-{secrets.token_hex(8)}"


def test_a_peer_path_through_dotdot_or_a_symlink_is_refused_and_nothing_is_mapped(pool, other, tmp_path):
    d = pool_dir()
    lure = os.path.join(d, pool_name())  # named like a pool, a symlink to the other file
    os.symlink(other, lure)
    to_pool = os.path.join(d, pool_name())  # a symlink to a real pool: still not the pool's own path
    os.symlink(pool.path, to_pool)
    small = os.path.join(d, pool_name())  # a pool-named file of another size
    with open(small, "wb") as f:
        f.write(b"\0" * (NBYTES // 2))
    outside = tmp_path / os.path.basename(pool.path)  # the right name in another directory
    outside.write_bytes(b"\0" * NBYTES)
    try:
        for path, why in [(os.path.join(d, "..", os.path.basename(other)), "not a KV pool"),
                          (os.path.join(d, "..", os.path.basename(d), os.path.basename(pool.path)), "not a KV pool"),
                          (lure, "not a KV pool"), (to_pool, "not a KV pool"), (str(outside), "not a KV pool"),
                          (small, f"{NBYTES // 2} bytes, expected {NBYTES}")]:
            with pytest.raises(PoolRefused, match=why) as e:
                KVPool.attach(path, SHAPE, torch.float32)
            assert e.value.code == "kv_pool_refused"
        assert not mapped(other) and not mapped(str(outside)) and not mapped(small)
        with open(other, "rb") as f:
            assert f.read() == b"\x01" * NBYTES  # untouched
        peer = KVPool.attach(pool.path, SHAPE, torch.float32)  # the pool's own path maps the pool
        peer.tensor.fill_(3.0)
        assert float(pool.tensor.min()) == 3.0 and not peer.owner
    finally:
        for path in (lure, to_pool, small):
            os.unlink(path)


def test_a_kv_sender_refuses_a_decode_pool_described_through_dotdot(pool, other):
    """A decode worker (or whoever answers on its kv port) describing its pool as ../another file:
    the prefill side's hand-off fails with PoolRefused, nothing is mapped, nothing is sent."""
    ctx = zmq.Context()
    bad = os.path.join(pool_dir(), "..", os.path.basename(other))
    receiver = KVReceiver(ctx, pool.tensor, shm_path=bad)
    sender = KVSender(ctx, "prefill-1", timeout=5, backend="shm")
    got: queue.Queue = queue.Queue()
    stop = threading.Event()

    def pump():  # the decode worker's I/O loop in miniature: answers KVConnect, queues hand-offs
        while not stop.is_set():
            if receiver.sock.poll(10):
                msg = receiver.recv()
                if msg is not None:
                    got.put(msg)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        ready = KVReady("r", [1, 2, 3], [7], SamplingParams(), [1, 2], 3, "?")
        with pytest.raises(PoolRefused, match="not a KV pool"):
            sender.send(torch.ones(SHAPE), [0, 1], ready, receiver.endpoint)
        assert sender.pools == {} and sender.dests == {} and not mapped(other)
        assert got.empty() and float(pool.tensor.abs().sum()) == 0.0  # no KVReady, no bytes in the decode pool
    finally:
        stop.set()
        thread.join(5)
        sender.close()
        receiver.close()
        ctx.destroy(linger=0)
