"""Moving granted KV blocks from a prefill worker's pool into a decode worker's pool.

Lifecycle: the decode side builds one `KVReceiver` over its pool; it binds a ROUTER (the
"kv endpoint" announced in its Hello) and is polled by the decode worker's I/O thread.
The prefill side builds one `KVSender`; per hand-off it calls `send(...)`, which moves the
bytes with the chosen backend and then delivers the `KVReady` header:
  shm: map the destination pool (once per destination) and copy blocks into it directly;
       the header follows on the kv socket, so it is seen only after the bytes are in place.
  tcp: one zero-copy frame per layer after the header; the receiver copies the frames into
       its granted blocks before it hands the header on.
Both sides validate shapes and block ids; a bad hand-off is counted and dropped, never fatal.
Backends `cuda_ipc` and `nccl` plug into the same two classes (GPU, not built yet).
"""
from __future__ import annotations

import time

import msgspec
import torch
import zmq

from coordinator.protocol import KVFailed, KVReady, PrefillToDecode, decoder, encode
from kvtransfer.pool import DTYPES, KVPool

BACKENDS = ("shm", "tcp")


def choose_backend(src_host: str, src_boot: str, dst_host: str, dst_boot: str, dst_shm_path: str, forced: str | None = None) -> str:
    """shm when both workers share a machine (same host and boot id) and the pool is shared."""
    if forced in ("cuda_ipc", "nccl"):
        from runtime.errors import NotSupportedError

        raise NotSupportedError(f"kv backend {forced!r} needs the GPU build, which is not available yet")
    if forced is not None and forced != "auto":
        if forced not in BACKENDS:
            raise ValueError(f"unknown kv backend {forced!r} (choose from auto, {', '.join(BACKENDS)})")
        if forced == "shm" and not (dst_shm_path and src_host == dst_host and src_boot == dst_boot):
            raise ValueError("kv backend shm needs both workers on one machine and a shared decode pool")
        return forced
    return "shm" if dst_shm_path and src_host == dst_host and src_boot == dst_boot else "tcp"


def block_runs(src: list[int], dst: list[int]):
    """Coalesce paired block ids into runs (src_start, dst_start, length) of consecutive ids."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    # dst, src: (layers, 2, num_blocks, block_size, KVH, D); block ids index dim 2
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])


class KVSender:
    def __init__(self, ctx: zmq.Context, identity: str):
        self.ctx = ctx
        self.identity = identity
        self.sockets: dict[str, zmq.Socket] = {}
        self.pools: dict[str, KVPool] = {}
        self.bytes_sent = 0
        self.seconds = 0.0

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(endpoint)
            self.sockets[endpoint] = sock
        return sock

    def _pool(self, path: str, shape: list[int], dtype: torch.dtype) -> KVPool:
        pool = self.pools.get(path)
        if pool is None:
            pool = self.pools[path] = KVPool.attach(path, shape, dtype)
        return pool

    def send(self, src: torch.Tensor, src_ids: list[int], msg: KVReady, endpoint: str, shm_path: str = "", shm_shape: list[int] | None = None) -> int:
        """Move src's blocks src_ids into the destination's msg.block_ids, then deliver msg. Returns bytes moved."""
        if len(src_ids) != len(msg.block_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(msg.block_ids)} granted blocks")
        t0 = time.perf_counter()
        per_block = src[:, :, 0].numel() * src.element_size()
        nbytes = per_block * len(src_ids)
        sock = self._socket(endpoint)
        if msg.backend == "shm":
            dst = self._pool(shm_path, shm_shape, src.dtype).tensor
            copy_blocks(dst, src, src_ids, msg.block_ids)
            sock.send(encode(msg))
        elif msg.backend == "tcp":
            idx = torch.tensor(src_ids, dtype=torch.int64)
            frames = [src[layer].index_select(1, idx).contiguous() for layer in range(src.shape[0])]
            sock.send_multipart([encode(msg), *[f.view(torch.uint8).numpy() for f in frames]], copy=False)
        else:
            raise ValueError(f"unknown kv backend {msg.backend!r}")
        self.bytes_sent += nbytes
        self.seconds += time.perf_counter() - t0
        return nbytes

    def fail(self, endpoint: str, request_id: str, reason: str) -> None:
        self._socket(endpoint).send(encode(KVFailed(request_id, reason)))

    def close(self) -> None:
        for s in self.sockets.values():
            s.close(linger=0)
        self.sockets.clear()
        self.pools.clear()


class KVReceiver:
    def __init__(self, ctx: zmq.Context, pool: torch.Tensor, bind: str = "tcp://127.0.0.1:*"):
        self.pool = pool
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        layer_bytes = pool[0].numel() * pool.element_size()
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(layer_bytes, 2**20))  # no frame can exceed one layer of the pool
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decode = decoder(PrefillToDecode)
        self.bad_messages = 0
        self.bytes_received = 0

    def recv(self):
        """One hand-off as (message, block frames), or None if it was bad and dropped (counted).

        Called from the I/O thread; the caller copies the frames in with `copy_in` from the
        thread that owns the blocks, once it has checked the grant is still live.
        """
        frames = self.sock.recv_multipart(copy=False)
        try:
            msg = self.decode.decode(frames[1].buffer)
            if isinstance(msg, KVReady):
                self._check(msg, frames[2:])
            return msg, frames[2:]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError):
            self.bad_messages += 1
            return None

    def _check(self, msg: KVReady, frames) -> None:
        pool = self.pool
        if not msg.block_ids or any(not 0 <= b < pool.shape[2] for b in msg.block_ids):
            raise ValueError("block id out of range")
        if msg.backend not in BACKENDS:
            raise ValueError("unknown backend")
        if msg.backend == "tcp":
            if len(frames) != pool.shape[0]:
                raise ValueError(f"{len(frames)} layer frames, expected {pool.shape[0]}")
            want = 2 * len(msg.block_ids) * pool[0, 0, 0].numel() * pool.element_size()
            if any(len(f.buffer) != want for f in frames):
                raise ValueError("layer frame of the wrong size")

    def copy_in(self, msg: KVReady, frames) -> None:
        """Copy tcp block frames (checked by recv) into msg.block_ids; shm bytes are already there."""
        if msg.backend != "tcp":
            return
        pool = self.pool
        shape = (2, len(msg.block_ids), *pool.shape[3:])
        want = len(frames[0].buffer)
        idx = torch.tensor(msg.block_ids, dtype=torch.int64)
        for layer, f in enumerate(frames):
            data = torch.frombuffer(f.buffer, dtype=pool.dtype).view(shape)
            pool[layer].index_copy_(1, idx, data)
        self.bytes_received += want * len(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


__all__ = ["BACKENDS", "DTYPES", "KVPool", "KVReceiver", "KVSender", "choose_backend", "copy_blocks"]
