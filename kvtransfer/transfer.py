"""Moving granted KV blocks from a prefill worker's pool into a decode worker's pool.

Lifecycle: the decode side builds one `KVReceiver` over its pool; it binds a ROUTER (the
"kv endpoint" announced in its Hello) and is polled by the decode worker's I/O thread.
The prefill side builds one `KVSender`. Before its first hand-off to a destination it asks on
the kv socket (KVConnect -> KVAccept: the one description of that pool, whatever the backend:
shape, dtype, host and boot id, its shm file, its GPU and IPC handle, what it can take) and picks
the backend from it (`choose_backend`: shm on one machine with a shared pool, cuda_ipc or nccl
between GPU pools, else tcp, or the one the worker was told to use). Per hand-off `send(...)`
moves the bytes with that backend (one class each in kvtransfer/backends.py, found by name) and
then delivers the `KVReady` header. A streamed hand-off (worker/handoff.py) sends each chunk's
finished blocks the same way under a `KVPart` header, and its KVReady then carries only the rest
(`streamed` names how many came before):
  shm: map the destination pool (once per destination) and copy blocks into it directly;
       the header follows on the kv socket, so it is seen only after the bytes are in place.
  tcp: one zero-copy frame per layer after the header; the receiver copies the frames into
       its granted blocks before it hands the header on.
  cuda_ipc: map the pool from its IPC handle (once), write into it and wait on a CUDA event
       before the header (kvtransfer.cuda_ipc).
  nccl: join a communicator (a second KVConnect, with the ncclUniqueId), send the layers after
       the header; the receiver scatters them in `copy_in` (kvtransfer.nccl).
The handshake refuses a destination whose pool stores KV otherwise than the sender's
(`check_same_storage`: dtype and row width, e.g. an int8 --kv-cache-dtype against a float32
one): KVDtypeMismatch, before any byte moves. GPU failures raise KVTransferError. A failed hand-off forgets the destination, so the next one
asks again. Both sides validate shapes and block ids: the sender refuses ids outside the
destination pool (InvalidHandoff) before writing; the receiver turns a KVReady whose ids or tcp
frames are wrong into a KVFailed for its grant (counted), so the decode worker frees that grant
and fails only that request, and a KVPart that is wrong into a `BadPart` (counted), on which the
decode worker gives the grant up (fenced while its writer may still write: decode/grants.py);
an undecodable message is counted and dropped, never fatal.
The kv socket admits one frame of up to max(one layer of the pool, MAX_CONTROL_MESSAGE): any
header the coordinator lets through (it refuses larger requests), and a tcp layer frame whose
exact size `_check` then demands.
"""
from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import msgspec
import torch
import zmq

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer.backends import AUTO_ORDER, BY_NAME, CUDA_IPC, NCCL, Route, moved_ids
from pdserve.kvtransfer.errors import InvalidHandoff, KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.heads import block_bytes
from pdserve.kvtransfer.pool import DTYPES, KVPool, copy_blocks, dtype_name, host_identity
from pdserve.wire.protocol import KVAccept, KVConnect, KVFailed, KVPart, KVReady, PrefillToDecode
from pdserve_client.protocol import MAX_CONTROL_MESSAGE, decoder, encode

BACKENDS = tuple(name for name, b in BY_NAME.items() if not b.gpu)  # ("shm", "tcp")
GPU_BACKENDS = tuple(name for name, b in BY_NAME.items() if b.gpu)  # ("cuda_ipc", "nccl")


def choose_backend(src_host: str, src_boot: str, dst_host: str, dst_boot: str, dst_shm_path: str, forced: str | None = None,
                   src_gpu: list[str] | None = None, dst_gpu: list[str] | None = None) -> str:
    """The backend's name: `forced` if it can work here (else ValueError or NotSupportedError), or
    for auto (None) the first of backends.AUTO_ORDER that reaches the destination: cuda_ipc on one
    machine and nccl otherwise when both workers offer it, shm on one machine with a shared pool, tcp.

    src_gpu/dst_gpu: the GPU backends each worker offers (KVAccept.backends); None = not known.
    """
    route = Route(src_host == dst_host and src_boot == dst_boot, dst_shm_path, src_gpu, dst_gpu)
    if forced is None or forced == "auto":
        return next(b.name for b in AUTO_ORDER if b.reaches(route))
    backend = BY_NAME.get(forced)
    if backend is None:
        raise ValueError(f"unknown kv backend {forced!r} (choose from auto, {', '.join(BY_NAME)})")
    backend.check_forced(route)
    return forced


def check_block_ids(ids: list[int], num_blocks: int) -> None:
    """InvalidHandoff unless ids is a non-empty list of block ids of a pool of num_blocks blocks
    (a negative id would index from the end: another request's block)."""
    if not ids or any(not 0 <= b < num_blocks for b in ids):
        raise InvalidHandoff(f"block ids outside the pool of {num_blocks} blocks")


class BadPart(NamedTuple):
    """A streamed hand-off's KVPart that failed the receiver's checks (its frames dropped)."""

    part: KVPart
    reason: str


def check_header(msg: KVReady | KVPart, num_blocks: int) -> None:
    """InvalidHandoff unless msg's block ids are in a pool of num_blocks blocks and its count of
    blocks streamed before (KVReady.streamed, KVPart.first) is one it can have."""
    check_block_ids(msg.block_ids, num_blocks)
    if isinstance(msg, KVReady) and not 0 <= msg.streamed < len(msg.block_ids):
        raise InvalidHandoff(f"{msg.streamed} of {len(msg.block_ids)} blocks streamed before the KVReady: at least one must come with it")
    if isinstance(msg, KVPart) and msg.first < 0:
        raise InvalidHandoff(f"a part from block {msg.first}")


class KVDtypeMismatch(KVTransferError):
    """The two workers' KV pools store KV differently (--kv-cache-dtype, or the model dtype)."""


def check_same_storage(dest: KVAccept, src, endpoint: str) -> None:
    """KVDtypeMismatch unless the decode pool `dest` (its KVAccept) stores a block's rows as src
    does: the same dtype (float32, bfloat16, uint8 (--kv-cache-dtype int8), float8_e4m3fn: kernels.kv_quant) and row width.
    Checked at the handshake, before any byte moves: a quantized block copied into a float pool
    (or the reverse) would be garbage, not an error."""
    ours = dtype_name(src.dtype) if src.dtype in DTYPES.values() else str(src.dtype)
    if dest.kv_dtype != ours or dest.kv_shape[-1] != src.shape[-1]:
        builds = (" (int8 pools: --kv-cache-dtype int8 of a build before 2026-12-08, whose rows were symmetric and unrotated; "
                  "uint8: the rotated asymmetric rows of later builds, kernels.kv_quant: run one build on both)"
                  if {dest.kv_dtype, ours} == {"int8", "uint8"} else "")
        raise KVDtypeMismatch(f"{endpoint}: the decode worker's KV cache is {dest.kv_dtype} (rows of {dest.kv_shape[-1]}), this prefill "
                              f"worker's {ours} (rows of {src.shape[-1]}): start both with the same --kv-cache-dtype (and --dtype)"
                              f"{builds}")


def gpu_backends(pool: torch.Tensor) -> list[str]:
    """The GPU backends a worker with this KV pool can take part in."""
    return [b.name for b in (CUDA_IPC, NCCL) if b.sends_from(pool)]


class KVSender:
    def __init__(self, ctx: zmq.Context, identity: str, curve: dict | None = None, timeout: float = 10.0, backend: str = "auto"):
        self.ctx = ctx
        self.identity = identity
        self.timeout = timeout  # the longest wait for an answer, a join or a GPU copy
        self.forced = None if backend == "auto" else backend  # WorkerConfig.kv_backend
        self.host, self.boot_id = host_identity()
        self.dests: dict[str, tuple[KVAccept, str]] = {}  # endpoint -> (its pool, the backend chosen)
        self.peers: dict[str, object] = {}  # endpoint -> cuda_ipc.IpcPeer | nccl.NcclSender
        self._nonce = itertools.count(1)
        self._accept = decoder(KVAccept)
        self.curve = curve or {}  # CurveZMQ client options (pdserve_client.keys.client_options)
        self.sockets: dict[str, zmq.Socket] = {}
        self.pools: dict[str, KVPool] = {}
        self.bytes_sent = 0
        self.seconds = 0.0

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)  # nothing large may come back
            sock.setsockopt(zmq.SNDHWM, 0)
            for opt, value in self.curve.items():
                sock.setsockopt(opt, value)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close(linger=0)  # an unusable endpoint (from a broken Hello) leaves no socket behind
                raise
            self.sockets[endpoint] = sock
        return sock

    def destination(self, endpoint: str, src: torch.Tensor) -> tuple[KVAccept, str]:
        """(the pool at endpoint, the backend to reach it from src), asked once per destination."""
        dest = self.dests.get(endpoint)
        if dest is None:
            pool = self.handshake(endpoint, KVConnect(self.identity, self.next_nonce()))
            check_same_storage(pool, src, endpoint)
            gpu = [b for b in pool.backends if b in GPU_BACKENDS]
            try:
                # a forced backend is tried as it is: a GPU one this side cannot do fails at its first use
                backend = choose_backend(self.host, self.boot_id, pool.host, pool.boot_id, pool.shm_path, self.forced,
                                         None if self.forced else gpu_backends(src), gpu)
            except (ValueError, NotSupportedError) as e:
                raise KVTransferError(f"{endpoint}: {e}") from e
            dest = self.dests[endpoint] = (pool, backend)
        return dest

    def send(self, src, src_ids: list[int], msg: KVReady | KVPart, endpoint: str) -> int:
        """Move src's blocks src_ids into the destination's blocks the header names (backends.moved_ids:
        a KVPart's, or a KVReady's less those streamed before it), then deliver msg. Returns bytes moved.
        src: the pool, a tensor or a tensor-parallel GPU worker's kvtransfer.heads.HeadParts."""
        if len(src_ids) != len(moved_ids(msg)):
            raise ValueError(f"{len(src_ids)} source blocks for {len(moved_ids(msg))} granted blocks")
        t0 = time.perf_counter()
        nbytes = block_bytes(src) * len(src_ids)
        try:
            pool, backend = self.destination(endpoint, src)
            check_header(msg, pool.kv_shape[2])
            msg = msgspec.structs.replace(msg, backend=backend)
            BY_NAME[backend].send(self, endpoint, pool, src, src_ids, msg, self._socket(endpoint))
        except BaseException:
            self.forget(endpoint)  # the next hand-off asks again and builds what it needs afresh
            raise
        self.bytes_sent += nbytes
        self.seconds += time.perf_counter() - t0
        return nbytes

    def fail(self, endpoint: str, request_id: str, reason: str, grant: int = 0) -> bool:
        """Tell the decode side its hand-off (of grant number `grant`) will not come. Runs on error
        paths, so it never raises: False if the endpoint is unusable (the grant then expires on its own)."""
        try:
            self._socket(endpoint).send(encode(KVFailed(request_id, reason, grant)))
            return True
        except zmq.ZMQError:
            return False

    def next_nonce(self) -> int:
        return next(self._nonce)

    def handshake(self, endpoint: str, ask: KVConnect) -> KVAccept:
        """KVConnect on the kv socket, then the KVAccept with its nonce (bounded wait)."""
        what = "nccl" if ask.nccl_id else "pool description"
        sock = self._socket(endpoint)
        sock.send(encode(ask))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                raise KVTransferTimeout(f"{what}: no answer from {endpoint} within {self.timeout:g} s")
            try:
                reply = self._accept.decode(sock.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if reply.nonce == ask.nonce:
                break
        if reply.error:
            raise KVTransferError(f"{what} refused by {endpoint}: {reply.error}")
        return reply

    def forget(self, endpoint: str) -> None:
        """Drop what this sender knows of a destination: its description, GPU peer and mapping."""
        dest = self.dests.pop(endpoint, None)
        if dest is not None and dest[0].shm_path:
            self.pools.pop(dest[0].shm_path, None)
        peer = self.peers.pop(endpoint, None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        for endpoint in list(self.dests) + list(self.peers):
            self.forget(endpoint)
        for s in self.sockets.values():
            s.close(linger=0)
        self.sockets.clear()
        self.pools.clear()


def describe(pool: torch.Tensor, ipc: KVAccept | None = None, shm_path: str = "", nonce: int = 0) -> KVAccept:
    """A decode pool as KVAccept tells it: shape, dtype, where it lives, which backends can reach it.
    ipc: its CUDA IPC export (cuda_ipc.CudaKVPool.accept); shm_path: its file in /dev/shm."""
    from pdserve.kvtransfer import nccl
    from pdserve.kvtransfer.cuda_ipc import device_id

    host, boot = host_identity()
    offers = (["shm"] if shm_path else []) + (["cuda_ipc"] if ipc is not None else []) + (["nccl"] if nccl.available(pool.device) else [])
    base = ipc if ipc is not None else KVAccept(0, list(pool.shape), dtype_name(pool.dtype), device=device_id(pool))
    return msgspec.structs.replace(base, nonce=nonce, host=host, boot_id=boot, backends=offers, shm_path=shm_path)


class KVReceiver:
    def __init__(self, ctx: zmq.Context, pool: torch.Tensor, bind: str = "tcp://127.0.0.1:*", curve: dict | None = None,
                 ipc: KVAccept | None = None, timeout: float = 10.0, shm_path: str = ""):
        self.pool = pool  # a tensor, or a tensor-parallel GPU worker's kvtransfer.heads.HeadParts
        self.ipc = ipc  # cuda_ipc: this pool's export (cuda_ipc.CudaKVPool.accept)
        self.shm_path = shm_path  # shm: the pool's file in /dev/shm ("" if private)
        self.nccl = None  # nccl.NcclInbox, made at the first nccl KVConnect
        self.timeout = timeout
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1000)  # bounded: a sender beyond it waits (TCP back-pressure), nothing is dropped
        layer_bytes = block_bytes(pool) // pool.shape[0] * pool.shape[2]
        # a frame is a header (bounded by the coordinator below MAX_CONTROL_MESSAGE) or a layer's blocks
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(layer_bytes, MAX_CONTROL_MESSAGE))
        for opt, value in (curve or {}).items():  # CurveZMQ server options (wire.security.server_options)
            self.sock.setsockopt(opt, value)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decode = decoder(PrefillToDecode)
        self.bad_messages = 0
        self.bytes_received = 0

    def recv(self):
        """One hand-off as (message, block frames), or None if it was undecodable and dropped
        (counted). A KVReady that fails its checks comes back as a KVFailed for its grant (counted):
        the decode worker frees that grant and fails that request only; a KVPart that fails
        them comes back as a BadPart (counted).

        Called from the I/O thread; the caller copies the frames in with `copy_in` from the
        thread that owns the blocks, once it has checked the grant is still live.
        """
        frames = self.sock.recv_multipart(copy=False)
        try:
            msg = self.decode.decode(frames[1].buffer)
            if isinstance(msg, KVConnect):
                self._connect(frames[0].bytes, msg)
                return None
            if isinstance(msg, (KVReady, KVPart)):
                try:
                    self._check(msg, frames[2:])
                except (ValueError, InvalidHandoff) as e:
                    self.bad_messages += 1
                    if isinstance(msg, KVPart):
                        return BadPart(msg, f"invalid hand-off part: {e}"), []
                    return KVFailed(msg.request_id, f"invalid hand-off: {e}", msg.grant), []
                return msg, BY_NAME[msg.backend].arrived(self, frames[0].bytes, msg, frames[2:])
            return msg, frames[2:]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError, KVTransferError):
            self.bad_messages += 1
            return None

    def _check(self, msg: KVReady | KVPart, frames) -> None:
        check_header(msg, self.pool.shape[2])
        backend = BY_NAME.get(msg.backend)
        if backend is None:
            raise ValueError("unknown backend")
        backend.check(self, msg, frames)

    def copy_in(self, msg: KVReady | KVPart, frames) -> None:
        """Copy tcp block frames (checked by recv) into backends.moved_ids(msg), or for nccl (frames: the
        receives recv posted) wait for them and scatter them, raising KVTransferError on failure;
        shm and cuda_ipc bytes are already there."""
        self.bytes_received += BY_NAME[msg.backend].copy_in(self, msg, frames)

    def _connect(self, peer: bytes, ask: KVConnect) -> None:
        """Answer a prefill worker's KVConnect (on the I/O thread): this pool's description, or
        for an nccl join, the join (made on a thread of the inbox's own), or why not."""
        reply = describe(self.pool, self.ipc, self.shm_path, ask.nonce)
        if ask.nccl_id and (why := NCCL.join(self, peer, ask, reply)):
            reply = msgspec.structs.replace(reply, error=why)
        self.sock.send_multipart([peer, encode(reply)])

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.close()
        self.sock.close(linger=0)


__all__ = ["BACKENDS", "DTYPES", "BadPart", "GPU_BACKENDS", "KVPool", "KVReceiver", "KVSender", "check_block_ids", "check_header",
    "choose_backend", "copy_blocks", "describe",
    "gpu_backends"]
