"""The KV hand-off backends, one class each, found by name in `BY_NAME` (a KVReady names the one
that moved its bytes; WorkerConfig.kv_backend may force one).

Lifecycle: each backend is one stateless object. The sender side (transfer.KVSender) asks
`reaches(route)` in `AUTO_ORDER` to pick one for a destination (or `check_forced(route)` for the
one it was told to use), and per hand-off calls `send`, which moves the bytes and then delivers
the header (a KVReady, or a streamed hand-off's KVPart: `moved_ids` names the blocks whose bytes
go with a header, the same way for both); the state a backend keeps per destination lives in the sender (`pools`: shm
mappings, `peers`: GPU peers) so that `KVSender.forget` drops it whatever the backend. The
receiver side (transfer.KVReceiver) calls `check` on each KVReady before it is handed on,
`arrived` as it hands it on (nccl posts its receives there) and `copy_in` on the thread owning
the blocks. shm and tcp move CPU pools; cuda_ipc and nccl GPU pools through cupy, which they
import only when used, so this module imports on machines with neither a GPU nor cupy. A pool is
a tensor or, for a tensor-parallel GPU worker, kvtransfer.heads.HeadParts (one part per rank):
every backend reads and writes through kvtransfer.heads, so pools of any TP sizes meet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.errors import NotSupportedError
from pdserve.kvtransfer import cuda_ipc, nccl
from pdserve.kvtransfer.errors import KVTransferError
from pdserve.kvtransfer.heads import block_bytes, copy_heads, gather_layer, scatter_layer, settle
from pdserve.kvtransfer.pool import DTYPES, KVPool
from pdserve.wire.protocol import KVAccept, KVConnect, KVPart, KVReady
from pdserve_client.protocol import encode


def moved_ids(msg: KVReady | KVPart) -> list[int]:
    """The destination blocks whose bytes go with this header: a KVPart's every block, a KVReady's
    all but the `streamed` first (they came in the grant's KVParts before it)."""
    return msg.block_ids if isinstance(msg, KVPart) else msg.block_ids[msg.streamed:]


@dataclass(frozen=True)
class Route:
    """What choosing a backend for one destination goes by: whether both workers share a machine
    (host and boot id), the decode pool's shm file ("" if private), and the GPU backends each
    side offers (None: not known)."""

    same_machine: bool
    shm_path: str
    src_gpu: list[str] | None = None
    dst_gpu: list[str] | None = None

    def both_offer(self, name: str) -> bool:
        return self.src_gpu is not None and self.dst_gpu is not None and name in self.src_gpu and name in self.dst_gpu


class KVBackend:
    """One way of moving a hand-off's blocks. Defaults: nothing to check, no frames after the header."""

    name = ""
    gpu = False  # needs GPU pools (and cupy) on both sides; offered in KVAccept.backends when it can be taken

    def reaches(self, route: Route) -> bool:
        """Whether `auto` may take it for this route."""
        raise NotImplementedError

    def check_forced(self, route: Route) -> None:
        """ValueError or NotSupportedError if it was forced where it cannot work."""

    def send(self, sender, endpoint: str, pool: KVAccept, src: torch.Tensor, src_ids: list[int], msg: KVReady | KVPart, sock) -> None:
        """Move src's blocks src_ids into the pool's moved_ids(msg), then send msg on sock."""
        raise NotImplementedError

    def check(self, receiver, msg: KVReady, frames) -> None:
        """ValueError if a KVReady of this backend (with `frames` after it) cannot be taken here."""
        if frames:
            raise ValueError(f"{self.name} hand-off with block frames")

    def arrived(self, receiver, peer: bytes, msg: KVReady, frames):
        """What the I/O thread hands on with a checked KVReady for `copy_in`."""
        return frames

    def copy_in(self, receiver, msg: KVReady, frames) -> int:
        """Put the bytes into moved_ids(msg) of receiver.pool; returns the bytes received that way."""
        return 0  # already in place


class Shm(KVBackend):
    """One machine, a shared decode pool: map it (once per destination) and copy blocks into it;
    the header follows on the kv socket, so it is seen only after the bytes are in place."""

    name = "shm"

    def reaches(self, route: Route) -> bool:
        return bool(route.shm_path) and route.same_machine

    def check_forced(self, route: Route) -> None:
        if not self.reaches(route):
            raise ValueError("kv backend shm needs both workers on one machine and a shared decode pool")

    def send(self, sender, endpoint, pool, src, src_ids, msg, sock) -> None:
        mapped = sender.pools.get(pool.shm_path)
        if mapped is None:
            if pool.kv_dtype not in DTYPES:
                raise ValueError(f"unknown kv dtype {pool.kv_dtype!r}")
            mapped = sender.pools[pool.shm_path] = KVPool.attach(pool.shm_path, pool.kv_shape, DTYPES[pool.kv_dtype])
        copy_heads(mapped.tensor, src, src_ids, moved_ids(msg))
        sock.send(encode(msg))

    def check(self, receiver, msg, frames) -> None:
        pass  # (frames after an shm header are ignored)


class Tcp(KVBackend):
    """Anywhere: one zero-copy frame per layer (every head) after the header; the receiver copies
    the frames into its granted blocks (GPU pools: through host memory; split pools: by heads)."""

    name = "tcp"

    def reaches(self, route: Route) -> bool:
        return True

    def send(self, sender, endpoint, pool, src, src_ids, msg, sock) -> None:
        idx = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
        frames = [gather_layer(src, layer, idx).contiguous().cpu() for layer in range(src.shape[0])]
        sock.send_multipart([encode(msg), *[f.view(torch.uint8).numpy() for f in frames]], copy=False)

    def check(self, receiver, msg, frames) -> None:
        pool = receiver.pool
        if len(frames) != pool.shape[0]:
            raise ValueError(f"{len(frames)} layer frames, expected {pool.shape[0]}")
        want = len(moved_ids(msg)) * block_bytes(pool) // pool.shape[0]
        if any(len(f.buffer) != want for f in frames):
            raise ValueError("layer frame of the wrong size")

    def copy_in(self, receiver, msg, frames) -> int:
        pool = receiver.pool
        ids = moved_ids(msg)
        shape = (2, len(ids), *pool.shape[3:])
        idx = torch.tensor(ids, dtype=torch.int64, device=pool.device)
        for layer, f in enumerate(frames):
            scatter_layer(pool, layer, idx, torch.frombuffer(f.buffer, dtype=pool.dtype).view(shape))
        settle(pool)
        return len(frames[0].buffer) * len(frames)


class GpuBackend(KVBackend):
    """A GPU backend: a peer per destination (kept in sender.peers), opened at its first hand-off."""

    gpu = True

    def reaches(self, route: Route) -> bool:
        return route.both_offer(self.name)

    def check_forced(self, route: Route) -> None:
        for side, offers in (("prefill", route.src_gpu), ("decode", route.dst_gpu)):
            if offers is not None and self.name not in offers:
                raise NotSupportedError(f"kv backend {self.name} needs a CUDA KV pool and cupy on both workers; "
                                        f"the {side} worker offers {list(offers) or 'none'}")

    def sends_from(self, pool: torch.Tensor) -> bool:
        """Whether a worker with this KV pool can send with it (cupy and a CUDA pool at least)."""
        return pool.is_cuda and cuda_ipc.has_cupy()

    def open(self, sender, endpoint: str, pool: KVAccept, src: torch.Tensor):
        raise NotImplementedError

    def send(self, sender, endpoint, pool, src, src_ids, msg, sock) -> None:
        peer = sender.peers.get(endpoint)
        if peer is None:
            try:
                peer = self.open(sender, endpoint, pool, src)
            except NotSupportedError as e:  # no cupy here: a failed hand-off, not a dead worker
                raise KVTransferError(str(e)) from e
            sender.peers[endpoint] = peer
        peer.send(src, src_ids, moved_ids(msg), lambda: sock.send(encode(msg)))

    def check(self, receiver, msg, frames) -> None:
        super().check(receiver, msg, frames)
        if not self.set_up(receiver):
            raise ValueError(f"{self.name} hand-off that was never set up")

    def set_up(self, receiver) -> bool:
        raise NotImplementedError


class CudaIpc(GpuBackend):
    """One machine: map the decode pool from its IPC handle (once), write into it and wait on a
    CUDA event before the header (kvtransfer/cuda_ipc.py)."""

    name = "cuda_ipc"

    def reaches(self, route: Route) -> bool:
        return route.same_machine and super().reaches(route)

    def check_forced(self, route: Route) -> None:
        if not route.same_machine:
            raise ValueError("kv backend cuda_ipc needs both workers on one machine")
        super().check_forced(route)

    def open(self, sender, endpoint, pool, src):
        return cuda_ipc.IpcPeer.open(pool, sender.timeout)

    def set_up(self, receiver) -> bool:
        return receiver.ipc is not None


class Nccl(GpuBackend):
    """Any two GPUs: join a communicator (a second KVConnect, with the ncclUniqueId), send the
    layers after the header; the receiver posts its receives as the header arrives and scatters
    them in `copy_in` (kvtransfer/nccl.py)."""

    name = "nccl"

    def sends_from(self, pool: torch.Tensor) -> bool:
        return super().sends_from(pool) and nccl.available(pool.device)

    def open(self, sender, endpoint, pool, src):
        uid = nccl.unique_id()
        accept = sender.handshake(endpoint, KVConnect(sender.identity, sender.next_nonce(), uid))
        return nccl.NcclSender.connect(uid, src.device, accept.kv_shape, sender.timeout)

    def set_up(self, receiver) -> bool:
        return receiver.nccl is not None

    def arrived(self, receiver, peer, msg, frames):
        return receiver.nccl.post(peer, len(moved_ids(msg)))  # posted for every header: sends and receives stay paired

    def copy_in(self, receiver, msg, frames) -> int:
        return receiver.nccl.finish(frames, moved_ids(msg))

    def join(self, receiver, peer: bytes, ask: KVConnect, reply: KVAccept) -> str:
        """Join the communicator a KVConnect names (on a thread of the inbox's own); "" or why not."""
        if self.name not in reply.backends:
            return f"kv backend 'nccl' is not available here (KV pool on {receiver.pool.device}, cupy and NCCL needed)"
        if receiver.nccl is None:
            receiver.nccl = nccl.NcclInbox(receiver.pool, receiver.timeout)
        receiver.nccl.connect(peer, ask.nccl_id)
        return ""


SHM, TCP, CUDA_IPC, NCCL = Shm(), Tcp(), CudaIpc(), Nccl()
BY_NAME: dict[str, KVBackend] = {b.name: b for b in (SHM, TCP, CUDA_IPC, NCCL)}
AUTO_ORDER = (CUDA_IPC, NCCL, SHM, TCP)  # auto takes the first that reaches the destination
