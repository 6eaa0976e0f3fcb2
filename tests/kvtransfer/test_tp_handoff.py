"""Hand-offs between workers of different tensor-parallel sizes on GPUs (kvtransfer.heads): a TP n
GPU worker's pool is n parts, rank r's holding its KV heads. On the CPU, the parts are CPU
tensors and everything but the device copies runs for real: the head routes, each backend's
reads and writes through kvtransfer.heads, the real KVSender/KVReceiver over loopback ZeroMQ
(tcp; cuda_ipc with the real IpcPeer.open over fake mappings; nccl over the fake transport of
test_gpu_backends). The `gpu` tests do it with CUDA pools: parts on several GPUs, real CUDA IPC
handles in a second process, NCCL between two GPUs; they skip where there are fewer GPUs than they
need."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer import cuda_ipc, nccl
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.heads import HeadParts, as_parts, block_bytes, copy_heads, gather_layer, scatter_layer
from pdserve.kvtransfer.transfer import KVReceiver, KVSender
from pdserve.runtime.config import EngineConfig, WorkerConfig
from pdserve.runtime.tp import kv_head_range
from pdserve.wire.protocol import KVAccept, KVReady
from pdserve.worker import tp_ranks
from tests.helpers import receive_handoff, run_in_child
from tests.kvtransfer.test_gpu_backends import Pump, ctx, fake_nccl, ready  # noqa: F401 (fixtures)

SHAPE = (2, 2, 16, 4, 6, 8)  # (layers, 2, num_blocks, block_size, KVH, D): 6 KV heads split 1, 2, 3 or 6 ways
SIZES = [(3, 1), (1, 3), (3, 3), (2, 3), (1, 1)]  # (prefill TP, decode TP)
SRC_IDS, DST_IDS = [0, 5, 6, 11], [9, 2, 3, 15]


def split(whole: torch.Tensor, n: int, devices=None):
    """whole's heads as a TP n worker holds them: HeadParts (n > 1) or the tensor itself (n = 1)."""
    devices = devices or [whole.device] * n
    parts = [whole[..., slice(*kv_head_range(whole.shape[-2], r, n)), :].clone().to(devices[r]) for r in range(n)]
    return parts[0] if n == 1 else HeadParts(parts)


def joined(pool) -> torch.Tensor:
    """A pool's parts put back together, on the CPU: (layers, 2, num_blocks, block_size, KVH, D)."""
    return torch.cat([p.cpu() for p in as_parts(pool)], dim=-2)


def expected(src: torch.Tensor) -> torch.Tensor:
    want = torch.zeros_like(src)
    want[:, :, DST_IDS] = src[:, :, SRC_IDS]
    return want


# ------------------------------------------------------------------ on the CPU


@pytest.mark.parametrize("src_n,dst_n", SIZES)
def test_copy_heads_fills_each_rank_with_its_heads(src_n, dst_n):
    whole = torch.randn(SHAPE)
    dst = split(torch.zeros(SHAPE), dst_n)
    copy_heads(dst, split(whole, src_n), SRC_IDS, DST_IDS)
    assert torch.equal(joined(dst), expected(whole))


def test_gather_and_scatter_whole_blocks():
    whole = torch.randn(SHAPE)
    idx = torch.tensor(SRC_IDS)
    for n in (1, 2, 3):
        pool = split(whole, n)
        assert pool.shape == whole.shape and block_bytes(pool) == whole[:, :, 0].numel() * 4 and pool.nbytes == whole.nbytes
        for layer in range(SHAPE[0]):
            assert torch.equal(gather_layer(pool, layer, idx), whole[layer].index_select(1, idx))
        into = split(torch.zeros(SHAPE), n)
        for layer in range(SHAPE[0]):
            scatter_layer(into, layer, torch.tensor(DST_IDS), whole[layer].index_select(1, idx))
        assert torch.equal(joined(into), expected(whole))
    with pytest.raises(ValueError, match="pool parts differ"):
        HeadParts([torch.zeros(SHAPE), torch.zeros(SHAPE, dtype=torch.bfloat16)])


def _handoff(sender: KVSender, receiver: KVReceiver, pump: Pump, src, backend: str) -> KVReady:
    sender.send(src, SRC_IDS, ready("r", DST_IDS, backend), receiver.endpoint)
    msg, frames = pump.get()
    receiver.copy_in(msg, frames)
    return msg


@pytest.mark.parametrize("src_n,dst_n", SIZES)
def test_tcp_handoff_across_tp_sizes(ctx, src_n, dst_n):
    whole = torch.randn(SHAPE)
    receiver = KVReceiver(ctx, split(torch.zeros(SHAPE), dst_n))
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend="tcp")
    try:
        msg = _handoff(sender, receiver, pump, split(whole, src_n), "tcp")
        assert msg.backend == "tcp" and torch.equal(joined(receiver.pool), expected(whole))
        assert receiver.bytes_received == sender.bytes_sent == len(SRC_IDS) * whole[:, :, 0].numel() * 4
    finally:
        for x in (pump, sender, receiver):
            x.close()


@pytest.fixture
def fake_ipc_parts(monkeypatch):
    """cuda_ipc.map_export maps a registered CPU tensor by its handle (the real IpcPeer.open runs)."""
    exports: dict[bytes, torch.Tensor] = {}
    calls = []

    def map_export(bus_id, handle, offset, shape, dtype):
        t = exports[handle]
        assert list(t.shape) == list(shape) and t.dtype == dtype  # each part mapped with its own heads' shape
        calls.append(handle)
        return t, lambda: calls.append(b"closed:" + handle)

    monkeypatch.setattr(cuda_ipc, "require_cupy", lambda: None)
    monkeypatch.setattr(cuda_ipc, "map_export", map_export)
    yield exports, calls
    monkeypatch.undo()
    cuda_ipc.has_cupy.cache_clear()  # nothing here may leave "cupy is there" cached


def ipc_parts_accept(pool, exports: dict) -> KVAccept:
    """What a TP GPU decode worker's rank 0 tells (worker.tp_ranks.RankPools.accept), its parts registered as exports."""
    handles = []
    for part in as_parts(pool):
        handles.append(os.urandom(64))
        exports[handles[-1]] = part
    return KVAccept(0, list(pool.shape), "float32", device="0000:00:00.0", ipc_parts=[("0000:00:00.0", h, 0) for h in handles])


@pytest.mark.parametrize("src_n,dst_n", SIZES)
def test_cuda_ipc_handoff_maps_every_part(ctx, fake_ipc_parts, src_n, dst_n):
    exports, calls = fake_ipc_parts
    whole = torch.randn(SHAPE)
    dst = split(torch.zeros(SHAPE), dst_n)
    receiver = KVReceiver(ctx, dst, ipc=ipc_parts_accept(dst, exports))
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=5, backend="cuda_ipc")
    try:
        msg = _handoff(sender, receiver, pump, split(whole, src_n), "cuda_ipc")
        assert msg.backend == "cuda_ipc" and torch.equal(joined(dst), expected(whole))
        assert len(calls) == dst_n  # every decode rank's pool mapped once
    finally:
        for x in (pump, sender, receiver):
            x.close()
    assert len([c for c in calls if c.startswith(b"closed:")]) == dst_n  # and unmapped when the sender closes


def test_cuda_ipc_refuses_parts_that_do_not_split_the_heads(ctx, fake_ipc_parts):
    exports, _ = fake_ipc_parts
    accept = ipc_parts_accept(split(torch.zeros(SHAPE), 3), exports)
    accept.ipc_parts.append(accept.ipc_parts[0])  # 4 parts of 6 heads
    with pytest.raises(KVTransferError, match="unusable pool export"):
        cuda_ipc.IpcPeer.open(accept, 1.0)


def test_rank_pools_gather_and_export_every_part(fake_ipc_parts):
    """Rank 0's side of a TP 3 GPU worker (worker.tp_ranks.RankPools): the others' exports from the
    group's store, mapped; its KVAccept lists every part, which a prefill worker maps back."""
    exports, calls = fake_ipc_parts
    parts = [torch.randn(*SHAPE[:4], 2, SHAPE[5]) for _ in range(3)]
    accepts = []
    for r, part in enumerate(parts):
        handle = os.urandom(64)
        exports[handle] = part
        accepts.append(KVAccept(0, list(part.shape), "float32", device=f"bus-{r}", ipc_handle=handle))
    closed = []
    own = SimpleNamespace(tensor=parts[0], accept=lambda: accepts[0], close=lambda: closed.append("own"))
    store = {tp_ranks.export_key(r): msgspec.msgpack.encode(accepts[r]) for r in (1, 2)}
    pools = tp_ranks.RankPools.gather(own, SimpleNamespace(size=3, fetch=store.__getitem__))
    assert pools.tensor is parts[0] and tp_ranks.handoff_pool(pools) is pools.parts and pools.parts.shape == SHAPE
    assert all(a is b for a, b in zip(pools.parts.parts, parts)) and pools.nbytes == sum(p.nbytes for p in parts)
    told = msgspec.msgpack.decode(msgspec.msgpack.encode(pools.accept(4)), type=KVAccept)
    assert told.nonce == 4 and told.kv_shape == list(SHAPE) and not told.ipc_handle
    assert told.ipc_parts == [(f"bus-{r}", a.ipc_handle, 0) for r, a in enumerate(accepts)]
    peer = cuda_ipc.IpcPeer.open(told, 1.0)
    assert all(a is b for a, b in zip(peer.dst.parts, parts))
    pools.close()
    assert closed == ["own"] and sorted(c for c in calls if c.startswith(b"closed:")) == sorted(b"closed:" + a.ipc_handle for a in accepts[1:])


def test_tp_on_cuda_without_cupy_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    started = []
    monkeypatch.setattr(tp_ranks.subprocess, "Popen", lambda *a, **k: started.append(a))
    econf = EngineConfig(device="cuda", tensor_parallel_size=2, num_blocks=8)
    with pytest.raises(NotSupportedError, match="tensor parallelism on CUDA is not supported without cupy"):
        tp_ranks.load_model(econf, WorkerConfig(), lambda shape, shared: pytest.fail("no pool before the refusal"))
    assert started == []


@pytest.mark.parametrize("src_n,dst_n", [(3, 1), (1, 3), (3, 3)])
def test_nccl_handoff_across_tp_sizes(ctx, fake_nccl, src_n, dst_n):
    """One communicator per pair of workers, whatever their TP sizes: every head gathered on the
    sender's rank 0, split into the receiver's parts."""
    whole = torch.randn(SHAPE)
    receiver = KVReceiver(ctx, split(torch.zeros(SHAPE), dst_n), timeout=1.0)
    pump, sender = Pump(receiver), KVSender(ctx, "prefill-1", timeout=1.0, backend="nccl")
    try:
        for _ in range(2):
            msg = _handoff(sender, receiver, pump, split(whole, src_n), "nccl")
            assert msg.backend == "nccl" and torch.equal(joined(receiver.pool), expected(whole))
        assert len(fake_nccl.wires) == 1
    finally:
        for x in (pump, sender, receiver):
            x.close()


# ------------------------------------------------------------------ on GPUs


def _need(gpus: int, what: str) -> None:
    pytest.importorskip("cupy")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{what} needs {gpus} CUDA devices, this machine has {torch.cuda.device_count()}")


def _devices(n: int, first: int = 0) -> list[str]:
    """n devices from cuda:first on, wrapping around the GPUs there are (parts may share a GPU)."""
    count = torch.cuda.device_count()
    return [f"cuda:{(first + r) % count}" for r in range(n)]


def receiver_child(out_path: str, dst_n: str, first: str) -> None:
    """A TP dst_n GPU decode worker's hand-off side in its own process: one CudaKVPool per part (as
    its ranks make them), the parts' exports in its KVAccept; saves its whole pool once a hand-off came."""
    n = int(dst_n)
    shape = (*SHAPE[:4], SHAPE[4] // n, SHAPE[5])
    pools = [cuda_ipc.CudaKVPool.create(shape, torch.bfloat16, d) for d in _devices(n, int(first))]
    pool = pools[0].tensor if n == 1 else HeadParts([p.tensor for p in pools])
    exports = [p.accept() for p in pools]
    ipc = KVAccept(0, list(SHAPE), "bfloat16", device=exports[0].device, ipc_parts=[(a.device, a.ipc_handle, a.ipc_offset) for a in exports])
    ctx = zmq.Context()
    receiver = KVReceiver(ctx, pool, ipc=ipc, timeout=60)
    print(receiver.endpoint, flush=True)
    msg = receive_handoff(receiver, 90)
    if msg is not None:
        torch.save({"backend": msg.backend, "pool": joined(pool)}, out_path)
    receiver.close()
    ctx.destroy(linger=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("src_n,dst_n", [(3, 1), (1, 3)])
def test_gpu_handoff_across_tp_sizes(tmp_path, backend, src_n, dst_n):
    """Parts on different GPUs where there are enough (else sharing them: CUDA IPC does not mind);
    NCCL needs the two rank 0s on two GPUs."""
    if backend == "nccl":
        _need(2, "an nccl hand-off (NCCL refuses two ranks of one communicator on one GPU)")
        if not nccl.available(torch.device("cuda", 0)):
            pytest.skip("cupy without NCCL")
    else:
        _need(1, "a cuda_ipc hand-off")
    out = tmp_path / "pool.pt"
    first = 1 if backend == "nccl" else 0  # the decode side's rank 0 on cuda:1, the prefill side's on cuda:0
    child = run_in_child(__file__, "receiver_child", out, dst_n, first)
    try:
        endpoint = child.stdout.readline().strip()
        ctx = zmq.Context()
        sender = KVSender(ctx, "prefill-gpu", timeout=60, backend=backend)
        whole = torch.randn(SHAPE).to(torch.bfloat16)
        sender.send(split(whole.cuda(), src_n, _devices(src_n)), SRC_IDS, ready("r", DST_IDS, backend), endpoint)
        assert child.wait(90) == 0
        saved = torch.load(out, weights_only=True)
        assert saved["backend"] == backend and torch.equal(saved["pool"], expected(whole))
        sender.close()
        ctx.destroy(linger=0)
    finally:
        child.kill()
