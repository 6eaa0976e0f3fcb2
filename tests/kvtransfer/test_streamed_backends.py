"""A streamed hand-off over every backend, through the real KVSender and KVReceiver on loopback
(shm and tcp as they run; cuda_ipc and nccl with their device parts replaced by the CPU fakes of
tests/kvtransfer/test_gpu_backends.py): KVParts bring the first blocks, the KVReady only the
rest (tcp: frames of those blocks only), and the decode pool ends with every block's bytes. The
receiver's checks on a part turn a bad one into a BadPart for its grant."""
from __future__ import annotations

import os

import pytest
import torch
import zmq

from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.transfer import BadPart, KVReceiver, KVSender
from pdserve.wire.protocol import KVPart, KVReady
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import encode
from tests.kvtransfer.test_gpu_backends import SHAPE, Pump, ctx, fake_ipc, fake_nccl, ipc_accept  # noqa: F401 (fixtures)

SRC_IDS, DST_IDS = [0, 1, 2, 3, 4], [9, 4, 5, 11, 2]


@pytest.fixture(params=["shm", "tcp", "cuda_ipc", "nccl"])
def link(request, ctx):  # noqa: F811 (the fixture imported above)
    """(sender, receiver, its pump, the decode pool) for one backend, forced."""
    backend = request.param
    shared = KVPool.create(SHAPE, torch.float32, shared=True) if backend == "shm" else None
    dst = shared.tensor if shared is not None else torch.zeros(SHAPE)
    ipc = None
    if backend == "cuda_ipc":
        handle = os.urandom(64)
        request.getfixturevalue("fake_ipc").pools[handle] = dst
        ipc = ipc_accept(dst, handle)
    elif backend == "nccl":
        request.getfixturevalue("fake_nccl")
    receiver = KVReceiver(ctx, dst, ipc=ipc, timeout=2.0, shm_path=shared.path if shared is not None else "")
    pump = Pump(receiver)
    sender = KVSender(ctx, "prefill-1", timeout=2.0, backend=backend)
    yield backend, sender, receiver, pump, dst
    pump.close()
    sender.close()
    receiver.close()
    if shared is not None:
        shared.close()


def ready(streamed: int) -> KVReady:
    return KVReady("r", [1, 2, 3], [7], SamplingParams(), DST_IDS, 3, "", grant=5, streamed=streamed)


def test_parts_then_the_rest_fill_every_granted_block(link):
    backend, sender, receiver, pump, dst = link
    src = torch.randn(SHAPE)
    block = src[:, :, 0].numel() * 4
    sent = [sender.send(src, SRC_IDS[:2], KVPart("r", DST_IDS[:2], 0, "", 5), receiver.endpoint),
            sender.send(src, SRC_IDS[2:4], KVPart("r", DST_IDS[2:4], 2, "", 5), receiver.endpoint),
            sender.send(src, SRC_IDS[4:], ready(4), receiver.endpoint)]
    assert sent == [2 * block, 2 * block, block]  # the KVReady moves only what was not streamed
    got = [pump.get() for _ in range(3)]
    assert [type(m) for m, _ in got] == [KVPart, KVPart, KVReady] and all(m.backend == backend for m, _ in got)
    if backend == "tcp":
        assert [len(frames) for _, frames in got] == [SHAPE[0]] * 3 and len(got[2][1][0].buffer) == block // SHAPE[0]
    for msg, frames in got:
        receiver.copy_in(msg, frames)
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS])
    if backend in ("tcp", "nccl"):
        assert receiver.bytes_received == 5 * block


def test_a_streamed_hand_off_moves_what_the_whole_one_does(link):
    backend, sender, receiver, pump, dst = link
    src = torch.randn(SHAPE)
    sender.send(src, SRC_IDS, ready(0), receiver.endpoint)
    receiver.copy_in(*pump.get())
    whole = dst[:, :, DST_IDS].clone()
    dst.zero_()
    sender.send(src, SRC_IDS[:3], KVPart("r", DST_IDS[:3], 0, "", 5), receiver.endpoint)
    sender.send(src, SRC_IDS[3:], ready(3), receiver.endpoint)
    for _ in range(2):
        receiver.copy_in(*pump.get())
    assert torch.equal(dst[:, :, DST_IDS], whole)


def test_the_kv_socket_turns_a_bad_part_into_a_bad_part_of_its_grant(ctx):  # noqa: F811
    pool = torch.zeros(SHAPE)
    rx = KVReceiver(ctx, pool)
    tx = ctx.socket(zmq.DEALER)
    tx.connect(rx.endpoint)
    layer = pool[0][:, :1].contiguous().numpy().tobytes()
    try:
        for part, frames, why in [
            (KVPart("r", [SHAPE[2]], 0, "tcp", 5), [layer] * SHAPE[0], "outside the pool"),
            (KVPart("r", [1], -1, "shm", 5), [], "a part from block -1"),
            (KVPart("r", [1], 0, "tcp", 5), [layer], "layer frames"),
            (KVPart("r", [1, 2], 0, "tcp", 5), [layer] * SHAPE[0], "wrong size"),
        ]:
            tx.send_multipart([encode(part), *frames])
            assert rx.sock.poll(5000)
            bad, rest = rx.recv()
            assert isinstance(bad, BadPart) and (bad.part.request_id, bad.part.grant) == ("r", 5) and why in bad.reason
            assert rest == []
        tx.send_multipart([encode(ready(len(DST_IDS)))])  # nothing left to come with the KVReady: refused too
        assert rx.sock.poll(5000)
        failed, _ = rx.recv()
        assert type(failed).__name__ == "KVFailed" and "at least one" in failed.reason
        assert rx.bad_messages == 5
    finally:
        tx.close(linger=0)
        rx.close()
