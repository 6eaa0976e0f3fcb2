"""An in-process KV hand-off: the KVSender and KVReceiver interface without sockets, for tests.

Lifecycle: one `LocalKV` stands for the wire between workers built in one process. A decode
side registers its pool under an endpoint name (`register`, which returns the inbox its
deliveries land in); a prefill side's `send` copies the granted blocks straight into that pool
(as shm does) and appends (KVReady, []) to the inbox (a streamed hand-off's KVPart likewise, its
blocks copied first), `fail` appends (KVFailed, []). The decode
worker takes inbox items with its ordinary `handle`, and `copy_in` has nothing left to do.
Counters match the real classes' (bytes_sent, seconds, bytes_received, bad_messages).
"""
from __future__ import annotations

import time

import torch

from pdserve.kvtransfer.backends import moved_ids
from pdserve.kvtransfer.heads import block_bytes, copy_heads
from pdserve.kvtransfer.transfer import check_header
from pdserve.wire.protocol import KVFailed, KVPart, KVReady


class LocalKV:
    def __init__(self):
        self.pools: dict[str, torch.Tensor] = {}
        self.inboxes: dict[str, list] = {}
        self.bytes_sent = self.bytes_received = self.bad_messages = 0
        self.seconds = 0.0

    def register(self, endpoint: str, pool: torch.Tensor) -> list:
        self.pools[endpoint] = pool
        return self.inboxes.setdefault(endpoint, [])

    def send(self, src: torch.Tensor, src_ids: list[int], msg: KVReady | KVPart, endpoint: str) -> int:
        """Copy src's blocks src_ids into the destination's blocks msg brings (backends.moved_ids), then deliver msg."""
        dest_ids = moved_ids(msg)
        if len(src_ids) != len(dest_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dest_ids)} granted blocks")
        if endpoint not in self.pools:
            raise ConnectionRefusedError(f"no pool is registered at {endpoint!r}")
        check_header(msg, self.pools[endpoint].shape[2])
        t0 = time.perf_counter()
        copy_heads(self.pools[endpoint], src, src_ids, dest_ids)  # pools of any TP split (kvtransfer.heads)
        nbytes = block_bytes(src) * len(src_ids)
        self.inboxes[endpoint].append((msg, []))
        self.bytes_sent += nbytes
        self.bytes_received += nbytes
        self.seconds += time.perf_counter() - t0
        return nbytes

    def fail(self, endpoint: str, request_id: str, reason: str, grant: int = 0) -> bool:
        if endpoint not in self.inboxes:
            return False
        self.inboxes[endpoint].append((KVFailed(request_id, reason, grant), []))
        return True

    def copy_in(self, msg: KVReady | KVPart, frames) -> None:
        """The bytes are in place already (send copied them)."""

    def close(self) -> None:
        pass
