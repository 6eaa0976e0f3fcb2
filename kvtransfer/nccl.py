"""NCCL: KV blocks sent GPU to GPU between a prefill and a decode worker, on one node or across nodes.

Lifecycle: one two-rank communicator per (prefill, decode) pair. Before its first hand-off to a
decode worker the prefill side makes an ncclUniqueId and sends it in KVConnect on that worker's kv
socket; the decode side's `NcclInbox.connect` answers KVAccept and joins as rank 1 on a thread of
its own, the prefill side joins as rank 0 (`NcclSender.connect`), each waiting at most `timeout`.
Per hand-off `NcclSender.send` gathers each layer's granted blocks into one buffer
(2, n, block_size, KVH, D), queues one send per layer (grouped) on its stream, delivers KVReady
and waits (bounded) on an event after the sends. The decode side posts the matching receives into
staging buffers as soon as it reads that header (`NcclInbox.post`, I/O thread), for every header
of that peer, so sends and receives stay paired even for a request it will drop; the decode loop's
`NcclInbox.finish` waits (bounded) for them and scatters them into the granted blocks. The host
waits, never the compute stream, so a lost peer cannot stall the model. On a timeout or error
either side aborts its communicator (which ends the other side's pending kernels too) and raises
KVTransferError; the worker frees the request's blocks on both sides, and the next hand-off builds
a new communicator. `Transport` is the seam: `CupyTransport` is NCCL through cupy, and the CPU
tests plug in a fake one through `join` and `unique_id`. cupy is imported inside functions only.
A tensor-parallel GPU worker's pool (kvtransfer.heads.HeadParts) takes part through its rank 0:
the sender gathers every head of a layer's blocks onto rank 0's GPU (kvtransfer.heads.gather_layer)
and the receiver splits them into its ranks' parts (scatter_layer), so one communicator per pair
of workers serves any TP sizes; the bytes pass through each side's rank 0 GPU.
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kvtransfer.errors import KVTransferError, KVTransferTimeout, wait_done
from pdserve.kvtransfer.heads import gather_layer, scatter_layer, settle


class Transport(Protocol):
    """One rank's end of a two-rank communicator; byte buffers, queued in call order."""

    def send(self, bufs: list[torch.Tensor]) -> None: ...
    def recv(self, bufs: list[torch.Tensor]) -> None: ...
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor: ...  # a receive buffer, safe to fill from the transport
    def record(self):  ...  # an event (has .query()) after everything queued so far
    def release(self, bufs: list[torch.Tensor]) -> None: ...  # bufs were read by the compute stream
    def abort(self) -> None: ...


# ------------------------------------------------------------------ cupy NCCL


def available(device: torch.device) -> bool:
    """Whether this process can join an NCCL communicator for a pool on `device`."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # no cupy, or a cupy built without NCCL
        return False
    return bool(getattr(nccl, "available", True))


def unique_id() -> bytes:
    from pdserve.kvtransfer.cuda_ipc import require_cupy

    require_cupy()
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    return bytes(b & 0xFF for b in uid) if isinstance(uid, tuple) else bytes(uid)  # older cupy: a tuple of chars


def join(uid: bytes, rank: int, device: torch.device) -> Transport:
    """Join the two-rank communicator `uid` as `rank` on `device` (blocks until both ranks joined)."""
    return CupyTransport.join(uid, rank, device)


class CupyTransport:
    def __init__(self, comm, device: torch.device, peer: int):
        from cupy.cuda import nccl

        self.comm = comm
        self.device = device
        self.peer = peer
        self.byte = nccl.NCCL_UINT8  # every buffer travels as bytes: NCCL has no bfloat16 before 2.10
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def join(cls, uid: bytes, rank: int, device: torch.device) -> CupyTransport:
        import cupy
        from cupy.cuda import nccl

        device = torch.device(device)
        with cupy.cuda.Device(device.index):
            try:
                comm = nccl.NcclCommunicator(2, uid, rank)
            except TypeError:  # older cupy takes the id as a tuple of signed chars
                comm = nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)
        return cls(comm, device, 1 - rank)

    def _each(self, op, bufs: list[torch.Tensor]) -> None:
        from cupy.cuda import nccl

        with torch.cuda.device(self.device):
            nccl.groupStart()  # one fused launch for all layers
            try:
                for b in bufs:
                    op(b.data_ptr(), b.numel() * b.element_size(), self.byte, self.peer, self.stream.cuda_stream)
            finally:
                nccl.groupEnd()

    def send(self, bufs: list[torch.Tensor]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gather that filled bufs
        for b in bufs:
            b.record_stream(self.stream)  # not reused by the compute stream before the send has read it
        self._each(self.comm.send, bufs)

    def recv(self, bufs: list[torch.Tensor]) -> None:
        self._each(self.comm.recv, bufs)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def record(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def release(self, bufs: list[torch.Tensor]) -> None:
        current = torch.cuda.current_stream(self.device)
        for b in bufs:
            b.record_stream(current)

    def abort(self) -> None:
        self.comm.abort()


def join_async(uid: bytes, rank: int, device: torch.device) -> concurrent.futures.Future:
    """`join` on a thread of its own: NCCL's init has no timeout, the caller's wait does."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(join(uid, rank, device))
        except BaseException as e:  # delivered to whoever waits
            fut.set_exception(e)

    threading.Thread(target=run, name=f"nccl-join-{rank}", daemon=True).start()
    return fut


def wait_joined(fut: concurrent.futures.Future, timeout: float) -> Transport:
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise KVTransferTimeout(f"nccl: the peer did not join the communicator within {timeout:g} s") from None
    except KVTransferError:
        raise
    except Exception as e:
        raise KVTransferError(f"nccl: joining the communicator failed: {e}") from e


def _abort(transport: Transport) -> None:
    try:
        transport.abort()
    except Exception:  # a communicator that already failed may refuse; it is dropped either way
        pass


# ------------------------------------------------------------------ prefill side


class NcclSender:
    """The prefill side of one pair: send a hand-off's blocks layer by layer."""

    def __init__(self, transport: Transport, dst_shape: list[int], timeout: float):
        self.transport = transport
        self.dst_shape = list(dst_shape)  # (layers, 2, num_blocks, block_size, KVH, D) of the decode pool
        self.timeout = timeout

    @classmethod
    def connect(cls, uid: bytes, device: torch.device, dst_shape: list[int], timeout: float) -> NcclSender:
        fut = join_async(uid, 0, device)
        try:
            return cls(wait_joined(fut, timeout), dst_shape, timeout)
        except KVTransferError:
            fut.add_done_callback(lambda f: f.exception() is None and _abort(f.result()))  # a late join leaks nothing
            raise

    def send(self, src: torch.Tensor, src_ids: list[int], dst_ids: list[int], deliver) -> None:
        """Queue the blocks, deliver() the header (the receiver posts its receives on reading it), wait."""
        d = self.dst_shape
        if list(src.shape[:2]) != d[:2] or list(src.shape[3:]) != d[3:]:
            raise KVTransferError(f"pool {tuple(src.shape)} cannot fill destination {tuple(d)}")
        idx = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
        bufs = [gather_layer(src, layer, idx) for layer in range(src.shape[0])]  # (2, n, bs, KVH, D) each, rank 0's GPU
        try:
            self.transport.send(bufs)
            done = self.transport.record()
            deliver()
            wait_done(done, self.timeout, f"nccl send of {len(src_ids)} blocks")
        except KVTransferError:
            _abort(self.transport)  # the peer's pending receives end with it
            raise
        except Exception as e:  # cupy's NcclError, a CUDA error, a failed header
            _abort(self.transport)
            raise KVTransferError(f"nccl send failed: {e}") from e

    def close(self) -> None:
        _abort(self.transport)


# ------------------------------------------------------------------ decode side


@dataclass
class Pending:
    """Receives posted for one hand-off: staging buffers (2, n, bs, KVH, D) per layer, and their event."""

    peer: bytes
    transport: Transport
    bufs: list[torch.Tensor]
    done: object


class NcclInbox:
    """The decode side: one communicator per prefill worker, keyed by its kv socket identity.

    connect/post run on the I/O thread, finish on the decode loop; a lock guards the table and
    each transport's use (an NCCL communicator is not thread-safe).
    """

    def __init__(self, pool: torch.Tensor, timeout: float):
        self.pool = pool  # (layers, 2, num_blocks, block_size, KVH, D)
        self.timeout = timeout
        self.peers: dict[bytes, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    def connect(self, peer: bytes, uid: bytes) -> None:
        """Join the peer's new communicator (rank 1) in the background; a previous one is aborted."""
        self.drop(peer)
        fut = join_async(uid, 1, self.pool.device)
        with self.lock:
            self.peers[peer] = fut
        fut.add_done_callback(lambda f: self._abort_if_dropped(peer, f))

    def _abort_if_dropped(self, peer: bytes, fut: concurrent.futures.Future) -> None:
        # A join that finishes after its peer was dropped (or replaced) must not leak a communicator.
        with self.lock:
            if self.peers.get(peer) is not fut and fut.exception() is None:
                _abort(fut.result())

    def post(self, peer: bytes, n_blocks: int) -> Pending:
        """Queue receives for n_blocks blocks of every layer from peer; KVTransferError if no communicator."""
        with self.lock:
            fut = self.peers.get(peer)
        if fut is None:
            raise KVTransferError("nccl: hand-off from a prefill worker with no communicator")
        try:
            transport = wait_joined(fut, self.timeout)
        except KVTransferError:
            self.drop(peer)
            raise
        p = self.pool
        with self.lock:
            bufs = [transport.empty((2, n_blocks, *p.shape[3:]), p.dtype) for _ in range(p.shape[0])]
            transport.recv(bufs)
            return Pending(peer, transport, bufs, transport.record())

    def finish(self, pending: Pending, block_ids: list[int]) -> int:
        """Wait (bounded) for pending's receives, copy them into block_ids of the pool; returns bytes."""
        try:
            wait_done(pending.done, self.timeout, f"nccl receive of {len(block_ids)} blocks")
        except KVTransferError:
            self.drop(pending.peer, pending.transport)
            raise
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.pool.device)
        for layer, buf in enumerate(pending.bufs):
            scatter_layer(self.pool, layer, idx, buf)
        settle(self.pool)
        pending.transport.release(pending.bufs)
        return sum(b.numel() * b.element_size() for b in pending.bufs)

    def drop(self, peer: bytes, transport: Transport | None = None) -> None:
        """Abort peer's communicator (only if it is still `transport`, when given) and forget it."""
        with self.lock:
            fut = self.peers.get(peer)
            if fut is None:
                return
            current = fut.result() if fut.done() and fut.exception() is None else None
            if transport is not None and current is not transport:
                return  # already replaced by a newer communicator
            self.peers.pop(peer)
            if current is not None:
                _abort(current)  # a join still running is aborted when it ends (_abort_if_dropped)

    def close(self) -> None:
        for peer in list(self.peers):
            self.drop(peer)
