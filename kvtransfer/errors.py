"""Typed errors of a KV hand-off, and the bounded wait that raises them.

Lifecycle: a GPU backend (cuda_ipc, nccl) raises `KVTransferError` when a hand-off fails and
`KVTransferTimeout` when it does not finish within its deadline, after it has released what it
holds (an aborted communicator, a dropped peer). Both are RuntimeErrors, so the prefill worker's
existing hand-off failure path frees the request's blocks and reports it; the decode worker
catches them around `KVReceiver.copy_in` and frees the grant. `InvalidHandoff` is a peer's
message that fails its checks (kvtransfer.transfer, decode and prefill workers). `wait_done` polls anything with a
`query()` (a CUDA event, or a fake one in the CPU tests) until it answers True or the time runs out.
"""
from __future__ import annotations

import time

from pdserve_client.errors import PdserveError


class KVTransferError(PdserveError, RuntimeError):
    """A hand-off of KV blocks between two workers failed; the request's blocks are freed."""

    code = "kv_transfer_failed"


class KVTransferTimeout(KVTransferError):
    code = "kv_transfer_timeout"


class InvalidHandoff(KVTransferError):
    """A peer's hand-off message names counts or block ids that do not fit the grant or the pool:
    refused before any of it reaches a copy or the engine; that request fails, the worker goes on."""


def wait_done(event, timeout: float, what: str) -> None:
    """Poll event.query() until True; KVTransferTimeout after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise KVTransferTimeout(f"{what} did not finish within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)  # a device-to-device copy takes microseconds; a stuck one should not spin a core
