"""The GPU kv backends (cuda_ipc, nccl). Everything that needs no GPU runs here on the CPU: the
handshake messages through msgspec, backend choice, imports without cupy, and the real
KVSender/KVReceiver over loopback ZeroMQ with the device parts replaced by fakes (a CPU tensor
for the mapped IPC pool, an in-process transport for NCCL), including the failure and timeout
paths, which must free the request's blocks on both workers. The `gpu` tests do the same on CUDA
with cupy: two processes, real IPC handles, the engine on the GPU."""
from __future__ import annotations

import itertools
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch
import zmq

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer import cuda_ipc, nccl
from pdserve.kvtransfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.pool import KVPool
from pdserve.kvtransfer.transfer import KVReceiver, KVSender, choose_backend, gpu_backends
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.kv_cache import BlockManager
from pdserve.wire.protocol import Admit, KVAccept, KVConnect, KVFailed, KVReady, Prefill, PrefillToDecode, WorkerError
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import decoder, encode
from tests.helpers import FakeLink, receive_handoff, run_in_child, save_tiny_model, tiny_engine

SHAPE = (3, 2, 16, 4, 2, 8)  # (layers, 2, num_blocks, block_size, KVH, D)


def ready(rid: str, block_ids: list[int], backend: str) -> KVReady:
    return KVReady(rid, [1, 2, 3], [7], SamplingParams(), block_ids, 3, backend)


class Pump:
    """The decode worker's I/O thread in miniature: recv() whatever arrives, queue what it returns."""

    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self.out: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            if self.receiver.sock.poll(10):
                got = self.receiver.recv()
                if got is not None:
                    self.out.put(got)

    def get(self, timeout: float = 5.0):
        return self.out.get(timeout=timeout)

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


# ------------------------------------------------------------------ wire and choice


def test_handshake_messages_round_trip():
    handle = bytes(range(64))
    ask = KVConnect("prefill-1", 7, bytes(range(128)))
    assert decoder(PrefillToDecode).decode(encode(ask)) == ask
    ans = KVAccept(7, list(SHAPE), "bfloat16", "h", "b", ["cuda_ipc"], "", "0000:1B:00.0", handle, 512)
    back = decoder(KVAccept).decode(encode(ans))
    assert back == ans and back.ipc_handle == handle and back.error == ""


def test_the_sender_picks_the_backend_from_the_pool_description(ctx):
    """The decode side describes its pool on KVConnect; the prefill side takes shm for a shared
    pool on its machine, tcp otherwise, or what it was told (a forced backend it cannot use fails typed)."""
    shared = KVPool.create(SHAPE, torch.float32, shared=True)
    receivers = [KVReceiver(ctx, shared.tensor, shm_path=shared.path), KVReceiver(ctx, torch.zeros(SHAPE))]
    pumps = [Pump(r) for r in receivers]
    auto, tcp = KVSender(ctx, "prefill-1", timeout=5), KVSender(ctx, "prefill-2", timeout=5, backend="tcp")
    src = torch.randn(SHAPE)
    try:
        for sender, receiver, pump, want in [(auto, receivers[0], pumps[0], "shm"), (auto, receivers[1], pumps[1], "tcp"),
                                             (tcp, receivers[0], pumps[0], "tcp")]:
            sender.send(src, [0, 5], ready("r", [2, 3], "?"), receiver.endpoint)
            msg, frames = pump.get()
            receiver.copy_in(msg, frames)
            assert msg.backend == want and torch.equal(receiver.pool[:, :, [2, 3]], src[:, :, [0, 5]])
            receiver.pool.zero_()
        assert auto.dests[receivers[0].endpoint][0].shm_path == shared.path and auto.dests[receivers[0].endpoint][0].backends == ["shm"]
        shm = KVSender(ctx, "prefill-3", timeout=5, backend="shm")
        with pytest.raises(KVTransferError, match="shared decode pool"):
            shm.send(src, [0], ready("r", [1], "?"), receivers[1].endpoint)
        assert shm.dests == {} and pumps[1].out.empty()
        shm.close()
    finally:
        for x in (*pumps, auto, tcp, *receivers):
            x.close()
        shared.close()


def test_cpu_choice_is_unchanged():
    assert choose_backend("a", "x", "a", "x", "/dev/shm/pdserve-kv-1") == "shm"
    assert choose_backend("a", "x", "b", "y", "/dev/shm/pdserve-kv-1") == "tcp"
    assert choose_backend("a", "x", "a", "x", "") == "tcp"
    assert choose_backend("a", "x", "a", "x", "/dev/shm/pdserve-kv-1", "tcp") == "tcp"
    with pytest.raises(ValueError):
        choose_backend("a", "x", "b", "y", "/dev/shm/pdserve-kv-1", "shm")
    with pytest.raises(ValueError):
        choose_backend("a", "x", "a", "x", "", "carrier-pigeon")
    # without GPU offers (unknown, or CPU pools) auto never picks a GPU backend
    assert choose_backend("a", "x", "a", "x", "") == "tcp"
    assert choose_backend("a", "x", "a", "x", "", None, [], []) == "tcp"


def test_gpu_choice():
    both = ["cuda_ipc", "nccl"]
    assert choose_backend("a", "x", "a", "x", "", None, both, both) == "cuda_ipc"
    assert choose_backend("a", "x", "b", "y", "", None, both, both) == "nccl"
    assert choose_backend("a", "x", "a", "x", "", "auto", ["nccl"], both) == "nccl"
    assert choose_backend("a", "x", "a", "x", "", None, both, []) == "tcp"  # a CPU decode pool
    assert choose_backend("a", "x", "a", "x", "", "nccl") == "nccl"  # forced, offers unknown: checked at hand-off
    with pytest.raises(ValueError, match="one machine"):
        choose_backend("a", "x", "b", "y", "", "cuda_ipc", both, both)
    with pytest.raises(NotSupportedError, match="decode worker offers none"):
        choose_backend("a", "x", "a", "x", "", "nccl", both, [])


def test_auto_dtype_is_bfloat16_on_cuda_only():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1", dtype="float16").dtype == "float16"


def test_imports_and_clear_errors_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    cuda_ipc.has_cupy.cache_clear()
    try:
        assert not cuda_ipc.has_cupy()
        with pytest.raises(NotSupportedError, match="pip install"):
            cuda_ipc.CudaKVPool.create(SHAPE, torch.float32, "cuda")
        with pytest.raises(NotSupportedError):
            nccl.unique_id()
        assert gpu_backends(torch.zeros(SHAPE)) == []
        assert not nccl.available(torch.device("cpu"))
        assert cuda_ipc.device_id(torch.zeros(1)) == ""
    finally:
        monkeypatch.undo()
        cuda_ipc.has_cupy.cache_clear()


# ------------------------------------------------------------------ cuda_ipc over a fake mapping


@pytest.fixture
def fake_ipc(monkeypatch):
    """IpcPeer.open maps a registered CPU tensor instead of a CUDA IPC handle."""
    pools: dict[bytes, torch.Tensor] = {}
    opened: list[KVAccept] = []

    def open_(accept, timeout):
        opened.append(accept)
        return cuda_ipc.IpcPeer(pools[accept.ipc_handle], timeout)

    monkeypatch.setattr(cuda_ipc.IpcPeer, "open", staticmethod(open_))
    return SimpleNamespace(pools=pools, opened=opened)


def ipc_accept(pool: torch.Tensor, handle: bytes) -> KVAccept:
    return KVAccept(0, list(pool.shape), "float32", device="0000:00:00.0", ipc_handle=handle)


def test_cuda_ipc_handoff_writes_blocks_before_the_header(ctx, fake_ipc):
    dst = torch.zeros(SHAPE)
    handle = os.urandom(64)
    fake_ipc.pools[handle] = dst
    receiver = KVReceiver(ctx, dst, ipc=ipc_accept(dst, handle))
    pump = Pump(receiver)
    sender = KVSender(ctx, "prefill-1", timeout=5, backend="cuda_ipc")  # auto would not: the source is a CPU tensor
    src = torch.randn(SHAPE)
    try:
        for rid, (src_ids, dst_ids) in enumerate([([0, 1, 2], [9, 4, 5]), ([7], [3])]):
            n = sender.send(src, src_ids, ready(f"r{rid}", dst_ids, "cuda_ipc"), receiver.endpoint)
            msg, frames = pump.get()
            assert msg.request_id == f"r{rid}" and list(frames) == []
            receiver.copy_in(msg, frames)  # nothing to copy: the bytes are in place already
            assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
            assert n == len(src_ids) * src[:, :, 0].numel() * 4
        assert len(fake_ipc.opened) == 1 and fake_ipc.opened[0].ipc_handle == handle  # mapped once per destination
        assert fake_ipc.opened[0].nonce == 1  # the answer to this sender's KVConnect
    finally:
        pump.close()
        sender.close()
        receiver.close()


def test_cuda_ipc_refused_by_a_cpu_pool_is_a_typed_failure(ctx):
    receiver = KVReceiver(ctx, torch.zeros(SHAPE))  # no export
    pump = Pump(receiver)
    sender = KVSender(ctx, "prefill-1", timeout=5, backend="cuda_ipc")
    try:
        with pytest.raises(KVTransferError, match="decode worker offers none") as e:
            sender.send(torch.randn(SHAPE), [0], ready("r", [1], "cuda_ipc"), receiver.endpoint)
        assert isinstance(e.value, RuntimeError)  # the prefill worker's hand-off failure path catches it
        assert sender.peers == {}
        assert pump.out.empty()  # no header went out
    finally:
        pump.close()
        sender.close()
        receiver.close()


def test_handshake_without_an_answer_times_out(ctx):
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    sender = KVSender(ctx, "prefill-1", timeout=0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(KVTransferTimeout):
            sender.send(torch.randn(SHAPE), [0], ready("r", [1], "cuda_ipc"), f"tcp://127.0.0.1:{port}")
        assert 0.25 < time.monotonic() - t0 < 3
    finally:
        sender.close()
        silent.close(linger=0)


def test_receiver_fails_gpu_headers_it_never_set_up(ctx):
    receiver = KVReceiver(ctx, torch.zeros(SHAPE))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(receiver.endpoint)
    try:
        for backend in ("cuda_ipc", "nccl"):
            dealer.send(encode(ready("r", [1], backend)))
            assert receiver.sock.poll(2000)
            failed, frames = receiver.recv()  # that grant fails (its decode worker frees it), counted
            assert isinstance(failed, KVFailed) and failed.request_id == "r" and "never set up" in failed.reason and frames == []
        assert receiver.bad_messages == 2
    finally:
        dealer.close(linger=0)
        receiver.close()


# ------------------------------------------------------------------ nccl over a fake transport


class Wire:
    """Both ends of one fake communicator: sends and receives pair up in order, as in NCCL."""

    def __init__(self, deliver: bool = True):
        self.deliver = deliver  # False: a peer that never takes part (lost, or stuck)
        self.sent: deque = deque()
        self.posted: deque = deque()
        self.lock = threading.Lock()

    def pump(self):
        with self.lock:
            while self.deliver and self.sent and self.posted:
                (s, src), (r, dst) = self.sent.popleft(), self.posted.popleft()
                assert src.numel() * src.element_size() == dst.numel() * dst.element_size(), "unpaired sizes"
                dst.view(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
                s.completed += 1
                r.completed += 1


class FakeTransport:
    def __init__(self, wire: Wire, rank: int, fail_send: bool = False):
        self.wire, self.rank, self.fail_send = wire, rank, fail_send
        self.queued = self.completed = 0
        self.aborted = False

    def send(self, bufs):
        if self.fail_send:
            raise RuntimeError("NCCL error: unhandled system error")
        with self.wire.lock:
            for b in bufs:
                self.queued += 1
                self.wire.sent.append((self, b.clone()))

    def recv(self, bufs):
        with self.wire.lock:
            for b in bufs:
                self.queued += 1
                self.wire.posted.append((self, b))

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def record(self):
        target = self.queued
        return SimpleNamespace(query=lambda: (self.wire.pump(), self.completed >= target)[1])

    def release(self, bufs):
        pass

    def abort(self):
        self.aborted = True
        self.wire.deliver = False


@pytest.fixture
def fake_nccl(monkeypatch):
    """nccl.unique_id/join/available backed by in-process wires; `plan` shapes the next wires."""
    state = SimpleNamespace(wires={}, transports=[], ids=itertools.count(), plan=deque(), join_gate=None)

    def unique_id():
        return b"uid-%d" % next(state.ids)

    def join(uid, rank, device):
        if state.join_gate is not None and rank == 0:
            state.join_gate.wait()  # a peer that never joins
        opts = state.plan[0] if state.plan else {}
        wire = state.wires.setdefault(uid, Wire(opts.get("deliver", True)))
        t = FakeTransport(wire, rank, fail_send=opts.get("fail_send", False) and rank == 0)
        state.transports.append(t)
        if rank == 0 and state.plan:
            state.plan.popleft()
        return t

    monkeypatch.setattr(nccl, "unique_id", unique_id)
    monkeypatch.setattr(nccl, "join", join)
    monkeypatch.setattr(nccl, "available", lambda device: True)
    yield state
    if state.join_gate is not None:
        state.join_gate.set()


@pytest.fixture
def pair(ctx):
    """A real KVSender and KVReceiver (its I/O thread pumping) over loopback, short timeouts."""
    dst = torch.zeros(SHAPE)
    receiver = KVReceiver(ctx, dst, timeout=1.0)
    pump = Pump(receiver)
    sender = KVSender(ctx, "prefill-1", timeout=1.0, backend="nccl")
    yield SimpleNamespace(dst=dst, receiver=receiver, pump=pump, sender=sender)
    pump.close()
    sender.close()
    receiver.close()


def test_nccl_handoff_layer_by_layer(pair, fake_nccl):
    src = torch.randn(SHAPE)
    for rid, (src_ids, dst_ids) in enumerate([([0, 1, 2], [9, 4, 5]), ([7, 8], [3, 15])]):
        pair.sender.send(src, src_ids, ready(f"r{rid}", dst_ids, "nccl"), pair.receiver.endpoint)
        msg, pending = pair.pump.get()
        pair.receiver.copy_in(msg, pending)
        assert torch.equal(pair.dst[:, :, dst_ids], src[:, :, src_ids])
    assert len(fake_nccl.wires) == 1  # one communicator for the pair, reused
    assert pair.receiver.bytes_received == 5 * src[:, :, 0].numel() * 4
    sends = [t for t in fake_nccl.transports if t.rank == 0]
    assert sends[0].queued == 2 * SHAPE[0]  # one message per layer per hand-off


def test_nccl_sender_timeout_aborts_and_reconnects(pair, fake_nccl):
    fake_nccl.plan.append({"deliver": False})  # the first communicator never delivers
    src = torch.randn(SHAPE)
    with pytest.raises(KVTransferTimeout):
        pair.sender.send(src, [0], ready("lost", [1], "nccl"), pair.receiver.endpoint)
    first = [t for t in fake_nccl.transports if t.rank == 0][0]
    assert first.aborted and pair.sender.peers == {}
    msg, pending = pair.pump.get()  # the header did arrive; its receive can never complete
    with pytest.raises(KVTransferTimeout):
        pair.receiver.copy_in(msg, pending)
    # the next hand-off builds a new communicator and goes through
    pair.sender.send(src, [2], ready("ok", [3], "nccl"), pair.receiver.endpoint)
    msg, pending = pair.pump.get()
    pair.receiver.copy_in(msg, pending)
    assert msg.request_id == "ok" and torch.equal(pair.dst[:, :, [3]], src[:, :, [2]])
    assert len(fake_nccl.wires) == 2


def test_nccl_send_error_is_typed_and_drops_the_peer(pair, fake_nccl):
    fake_nccl.plan.append({"fail_send": True})
    with pytest.raises(KVTransferError, match="unhandled system error"):
        pair.sender.send(torch.randn(SHAPE), [0], ready("r", [1], "nccl"), pair.receiver.endpoint)
    assert pair.sender.peers == {}
    assert [t for t in fake_nccl.transports if t.rank == 0][0].aborted
    assert pair.pump.out.empty()  # the header is sent only after the sends were queued


def test_nccl_peer_that_never_joins_times_out(pair, fake_nccl):
    fake_nccl.join_gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="join"):
        pair.sender.send(torch.randn(SHAPE), [0], ready("r", [1], "nccl"), pair.receiver.endpoint)
    assert time.monotonic() - t0 < 3 and pair.sender.peers == {}


# ------------------------------------------------------------------ both workers free their blocks


def decode_side(receiver: KVReceiver, num_blocks: int):
    from pdserve.worker.any_role import Worker

    # the grant bookkeeping, without a model: any token id and params pass the hand-off's checks
    engine = SimpleNamespace(blocks=BlockManager(num_blocks, SHAPE[3]), cfg=SimpleNamespace(vocab_size=2**31), validate=lambda *a: None)
    return Worker("decode-1", engine, receiver, FakeLink())


@pytest.fixture(scope="module")
def tiny_kv_model(tmp_path_factory):
    """A tiny checkpoint whose KV pool has SHAPE's layers, heads and head size."""
    d = tmp_path_factory.mktemp("tiny-kv")
    save_tiny_model(d, hidden_size=32, num_attention_heads=4, num_key_value_heads=SHAPE[4], num_hidden_layers=SHAPE[0])
    return d


def prefill_side(sender: KVSender, model_dir):
    """A prefill worker in prefill mode on a pool of SHAPE; returns it and a job maker (Prefill messages)."""
    from pdserve.prefill.fixed_worker import PrefillWorker

    engine, pool = tiny_engine(model_dir, prefill_only=True, num_blocks=SHAPE[2], block_size=SHAPE[3])
    assert tuple(pool.shape) == SHAPE
    p = PrefillWorker("prefill-1", engine, pool, sender, FakeLink())
    sent_from = []  # the source block ids of each hand-off
    real_send = sender.send
    sender.send = lambda src, src_ids, *a: sent_from.append(list(src_ids)) or real_send(src, src_ids, *a)

    def job(rid, prompt_len, dest_blocks, endpoint):
        return Prefill(rid, list(range(1, prompt_len + 1)), SamplingParams(), "decode-1", endpoint, dest_blocks)

    p.sent_from = sent_from
    return p, job


def test_nccl_timeout_frees_blocks_on_both_workers(pair, fake_nccl, tiny_kv_model):
    fake_nccl.plan.append({"deliver": False})
    d = decode_side(pair.receiver, SHAPE[2])
    p, job = prefill_side(pair.sender, tiny_kv_model)
    d.on_admit(Admit("r", 10))  # grants 3 blocks of 4 tokens
    granted = d.grants["r"].block_ids
    assert d.engine.blocks.free_blocks == SHAPE[2] - 3
    p.handle(job("r", 10, granted, pair.receiver.endpoint))

    p.step()  # the prompt runs; its send times out
    assert p.sent_from == [[0, 1, 2]] and p.engine.blocks.free_blocks == SHAPE[2]
    assert [(type(m), m.code) for m in p.link.sent] == [(WorkerError, "kv_transfer_failed")]
    for _ in range(2):  # the header, then the KVFailed the prefill side sent after the timeout
        d.handle(pair.pump.get())
    assert d.engine.blocks.free_blocks == SHAPE[2] and d.grants == {}
    assert [m.code for m in d.link.sent if isinstance(m, WorkerError)] == ["kv_transfer_timeout"]


def test_kv_failed_before_the_header_frees_the_grant(pair, fake_nccl, tiny_kv_model):
    fake_nccl.plan.append({"fail_send": True})
    d = decode_side(pair.receiver, SHAPE[2])
    p, job = prefill_side(pair.sender, tiny_kv_model)
    d.on_admit(Admit("r", 5))
    p.handle(job("r", 5, d.grants["r"].block_ids, pair.receiver.endpoint))
    p.step()
    msg, frames = pair.pump.get()
    assert isinstance(msg, KVFailed)
    d.handle((msg, frames))
    assert d.engine.blocks.free_blocks == SHAPE[2] and p.engine.blocks.free_blocks == SHAPE[2]
    assert [m.code for m in d.link.sent if isinstance(m, WorkerError)] == ["kv_transfer_failed"]


def test_successful_nccl_handoff_through_the_workers(pair, fake_nccl, tiny_kv_model):
    d = decode_side(pair.receiver, SHAPE[2])
    added = []
    d.engine.add_prefilled = lambda *a, **k: added.append(a) or SimpleNamespace(request_id=a[0], token_id=a[2][-1], logprob=None,
                                                                                top_logprobs=None, finish_reason=None)
    d.emit = lambda outs: None
    p, job = prefill_side(pair.sender, tiny_kv_model)
    d.on_admit(Admit("r", 9))
    p.handle(job("r", 9, d.grants["r"].block_ids, pair.receiver.endpoint))
    p.step()
    assert p.engine.blocks.free_blocks == SHAPE[2] and type(p.link.sent[0]).__name__ == "PrefillDone"
    d.handle(pair.pump.get())
    assert added and added[0][0] == "r" and len(added[0][2]) == 1  # the first token, sampled by the prefill side
    assert torch.equal(pair.dst[:, :, added[0][4]], p.pool[:, :, p.sent_from[0]]) and p.pool.abs().sum() > 0


# ------------------------------------------------------------------ on a GPU


def _run_child(fn: str, *args) -> subprocess.Popen:
    return run_in_child(__file__, fn, *args)


def ipc_receiver_child(out_path: str, device: str = "cuda:0", dtype: str = "bfloat16") -> None:
    """A decode side in its own process: a CUDA IPC pool, answers KVConnect, saves the blocks it is sent."""
    from pdserve.kvtransfer.pool import DTYPES

    pool = cuda_ipc.CudaKVPool.create(SHAPE, DTYPES[dtype], device)
    ctx = zmq.Context()
    receiver = KVReceiver(ctx, pool.tensor, ipc=pool.accept())
    print(receiver.endpoint, flush=True)
    msg = receive_handoff(receiver, 60)
    if msg is not None:
        torch.save({"ids": msg.block_ids, "blocks": pool.tensor[:, :, msg.block_ids].cpu()}, out_path)
    receiver.close()
    ctx.destroy(linger=0)


@pytest.mark.gpu
def test_cuda_pool_exports_a_handle():
    pytest.importorskip("cupy")
    pool = cuda_ipc.gpu_pool(SHAPE, torch.bfloat16, "cuda")
    assert isinstance(pool, cuda_ipc.CudaKVPool) and pool.tensor.is_cuda and pool.tensor.dtype == torch.bfloat16
    assert pool.tensor.shape == SHAPE and not pool.tensor.any()
    acc = pool.accept(5)
    assert acc.nonce == 5 and len(acc.ipc_handle) == 64 and acc.device == cuda_ipc.device_id(pool.tensor)
    assert gpu_backends(pool.tensor)[0] == "cuda_ipc"


@pytest.mark.gpu
def test_cuda_ipc_between_two_processes(tmp_path):
    pytest.importorskip("cupy")
    out = tmp_path / "blocks.pt"
    child = _run_child("ipc_receiver_child", out)
    try:
        endpoint = child.stdout.readline().strip()
        ctx = zmq.Context()
        sender = KVSender(ctx, "prefill-gpu", timeout=30)  # auto: both pools are CUDA, on one machine: cuda_ipc
        src = torch.randn(SHAPE, device="cuda").to(torch.bfloat16)
        src_ids, dst_ids = [4, 5, 6, 11], [0, 13, 14, 2]
        sender.send(src, src_ids, ready("r", dst_ids, "cuda_ipc"), endpoint)
        assert child.wait(60) == 0
        saved = torch.load(out, weights_only=True)
        assert saved["ids"] == dst_ids and torch.equal(saved["blocks"], src[:, :, src_ids].cpu())
        sender.close()
        ctx.destroy(linger=0)
    finally:
        child.kill()


def nccl_receiver_child(out_path: str) -> None:
    """A decode side on the second GPU, in its own process: joins the sender's communicator as rank 1."""
    pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:1")
    ctx = zmq.Context()
    receiver = KVReceiver(ctx, pool, timeout=30)
    print(receiver.endpoint, flush=True)
    msg = receive_handoff(receiver, 90)
    if msg is not None:
        torch.save({"ids": msg.block_ids, "blocks": pool[:, :, msg.block_ids].cpu()}, out_path)
    receiver.close()
    ctx.destroy(linger=0)


@pytest.mark.gpu
def test_nccl_between_two_processes(tmp_path):
    if torch.cuda.device_count() < 2 or not nccl.available(torch.device("cuda", 0)):
        pytest.skip("nccl needs two GPUs (NCCL refuses two ranks on one device) and cupy with NCCL")
    out = tmp_path / "blocks.pt"
    child = _run_child("nccl_receiver_child", out)
    try:
        endpoint = child.stdout.readline().strip()
        ctx = zmq.Context()
        sender = KVSender(ctx, "prefill-gpu", timeout=60, backend="nccl")  # one machine: auto would take cuda_ipc
        src = torch.randn(SHAPE, device="cuda:0").to(torch.bfloat16)
        sender.send(src, [1, 2, 3], ready("r", [7, 8, 0], "nccl"), endpoint)
        assert child.wait(90) == 0
        saved = torch.load(out, weights_only=True)
        assert torch.equal(saved["blocks"], src[:, :, [1, 2, 3]].cpu())
        sender.close()
        ctx.destroy(linger=0)
    finally:
        child.kill()


@pytest.mark.gpu
def test_engine_on_cuda_matches_the_cpu(tmp_path):
    from pdserve.runtime.engine import LLMEngine
    from tests.helpers import save_tiny_model

    save_tiny_model(tmp_path, max_position_embeddings=256)
    prompts = [[3 + (i * 7 + j * 13) % 500 for j in range(n)] for i, n in enumerate([5, 40, 1, 23, 64, 9])]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**kw):
        eng = LLMEngine.load(str(tmp_path), EngineConfig(num_blocks=64, block_size=16, **kw), progress=False, tokenizer=False)
        out = [c.token_ids for c in eng.generate(prompts, greedy)]
        assert eng.blocks.free_blocks == eng.blocks.num_blocks
        return eng, out

    _, cpu = run()
    eng, gpu = run(device="cuda", dtype="float32")
    assert eng.runner.kv_cache.is_cuda
    # float32 Triton kernels (ieee dots) and cuBLAS against the CPU path: a rounding near-tie may
    # flip one sequence's tail, never the first tokens
    assert [t[0] for t in gpu] == [t[0] for t in cpu]
    assert sum(a == b for a, b in zip(gpu, cpu)) >= len(cpu) - 1
    eng, bf16 = run(device="cuda")
    assert eng.config.dtype == "bfloat16" and eng.runner.kv_cache.dtype == torch.bfloat16
    assert all(len(t) == 16 for t in bf16)
    assert sum(a[0] == b[0] for a, b in zip(bf16, cpu)) >= len(cpu) - 1, "bfloat16 first tokens should agree with float32"
