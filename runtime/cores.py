"""Sharing one node's cores between the worker processes of one launch: the busy ones get them.

Why: a static split (each of N workers on cores / N threads for its whole life) leaves the
decode worker on one core while the prefill worker idles between bursts, and the reverse. Giving
every worker all cores instead oversubscribes them whenever two are busy, and OpenMP's barriers
then wait on preempted threads. Here each worker says when it is busy; a busy worker runs on
cores // (busy workers) threads, re-read before every step.

Prefill first: a busy prefill worker marks itself so (flag 2), and a decode worker on the same
node then defers its steps (`defer_to_prefill`): it stays idle, so the prefill worker runs on
every core, and steps only when its last step ended a stall cap ago (`stall_cap`: 3 s, or 0.4 of
the coordinator's TPOT target under SLO control); a prefill worker
sizes its threads by the busy prefill workers alone (a decode step at the cap briefly
oversubscribes the cores rather than halving a multi-second prefill step: measured, a 32-prompt
burst's TTFT median / p99 5.1 / 10.0 s against 7.8 / 13.2 s with the deferral alone). Time to first token
is what a backed-up prefill queue costs, and each prompt's whole prefill waits on it, while a
decode stream loses at most the cap per token: split 1 + 1 on two cores, a burst of 32 prompts
took the prefill worker twice as long and the disaggregated p99 TTFT was 1.65x vLLM's.

Lifecycle: the launcher calls `create_share(n_workers)` once (a file of one byte per worker in
/dev/shm) and hands worker i the spec "PATH:i" (`--core-share`); it unlinks the file when it
stops. A worker builds `CoreShare.open(spec, cores)`, calls `busy()` before each step it is
about to run and `idle()` before it waits for work, and `close()` (idle) on exit. A worker
started without a spec gets `StaticCores`, whose calls do nothing: it keeps the thread count it
was given. A worker killed while busy leaves
its byte set until it (or its replacement in the same slot) starts again: the others run on
fewer threads meanwhile, never more, so the failure mode is slow, not oversubscribed.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import torch


def create_share(num_workers: int, directory: str | None = None) -> str:
    """Create the shared busy flags for num_workers workers; returns the file's path."""
    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix="pdserve-cores-", dir=directory)
    try:
        os.write(fd, bytes(max(1, num_workers)))
    finally:
        os.close(fd)
    return path


# How long a deferring decode worker holds its streams (the latency it adds to their tokens)
# before it steps anyway. Without SLO control, DECODE_STALL_CAP_S: measured on 2 cores
# (`scripts/vs_vllm --rows disagg`, 128/128), a burst of 64 prompts had its p99 TTFT at
# 20.8 s with a 0.5 s cap and 15.9 s with 3 s, and mean TPOT 293 against 279 ms (each decode step
# that runs during a prefill step takes its cores from it, and a step of 64 streams is long);
# 32 prompts: p99 TTFT 10.7 s at 0.2 s, 8.8 at 0.5, 8.6 at 2 s. vLLM's chunked prefill makes the
# same trade: each of its steps during a burst carries up to 2,048 prompt tokens, seconds here.
# With SLO control the coordinator's Welcome names its TPOT target and the cap is
# STALL_SHARE_OF_TPOT of it (0.2 s at the default 500 ms target), so held streams still meet it.
DECODE_STALL_CAP_S = 3.0
STALL_SHARE_OF_TPOT = 0.4


def stall_cap(tpot_ms: float) -> float:
    """The decode worker's stall cap for the coordinator's TPOT target (0: no SLO control)."""
    return min(DECODE_STALL_CAP_S, STALL_SHARE_OF_TPOT * tpot_ms / 1000) if tpot_ms > 0 else DECODE_STALL_CAP_S


class CoreShare:
    def __init__(self, path: str, slot: int, cores: int):
        self.cores = max(1, cores)
        with open(path, "r+b") as f:
            self.flags = mmap.mmap(f.fileno(), 0)
        if not 0 <= slot < len(self.flags):
            raise ValueError(f"core-share slot {slot} outside the {len(self.flags)} workers of {path}")
        self.slot = slot
        self.threads = torch.get_num_threads()
        self.flags[slot] = 0

    @classmethod
    def open(cls, spec: str | None, cores: int | None = None) -> "CoreShare | StaticCores":
        """From a "PATH:SLOT" spec; without one, StaticCores (the worker keeps its threads)."""
        if not spec:
            return StaticCores()
        path, _, slot = spec.rpartition(":")
        if not path or not slot.isdigit():
            raise ValueError(f"--core-share must be PATH:SLOT, got {spec!r}")
        return cls(path, int(slot), cores or os.cpu_count() or 1)

    def busy_workers(self) -> int:
        flags = self.flags[:]
        return max(1, len(flags) - flags.count(0))

    def busy(self, prefill: bool = False) -> int:
        """Mark this worker busy (a prefill worker says so) and size its thread pool for the busy
        workers; returns threads."""
        self.flags[self.slot] = 2 if prefill else 1
        # a prefill worker shares the cores with the other busy prefill workers only: decode
        # workers defer to it (defer_to_prefill), apart from one short step per DECODE_STALL_CAP_S
        sharing = self.flags[:].count(2) if prefill else self.busy_workers()
        threads = max(1, self.cores // max(1, sharing))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        self.flags[self.slot] = 0

    def defer_to_prefill(self, since_last_step: float, cap: float = DECODE_STALL_CAP_S) -> bool:
        """Whether a decode worker should hold its next step: another worker of the node is busy
        prefilling and this one stepped less than `cap` seconds ago (stall_cap)."""
        flags = self.flags[:]
        return since_last_step < cap and any(f == 2 for i, f in enumerate(flags) if i != self.slot)

    def close(self) -> None:
        if not self.flags.closed:
            self.idle()
            self.flags.close()


class StaticCores:
    """The no-op share of a worker started without --core-share."""

    def busy(self, prefill: bool = False) -> int:
        return torch.get_num_threads()

    def idle(self) -> None:
        pass

    def defer_to_prefill(self, since_last_step: float, cap: float = DECODE_STALL_CAP_S) -> bool:
        return False

    def close(self) -> None:
        pass
