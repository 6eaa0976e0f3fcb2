"""Sharing one node's cores between the worker processes of one launch: the busy ones get them.

Why: a static split (each of N workers on cores / N threads for its whole life) leaves the
decode worker on one core while the prefill worker idles between bursts, and the reverse. Giving
every worker all cores instead oversubscribes them whenever two are busy, and OpenMP's barriers
then wait on preempted threads. Here each worker says when it is busy; a busy worker runs on
cores // (busy workers) threads, re-read before every step.

Prefill first: a busy prefill worker marks itself so (PREFILLING), and a decode worker on the
same node then defers its steps (`defer_to_prefill`): it stays idle, so the prefill worker runs
on every core. Turns: a while after its last step the decode worker asks for one (WANTS_TURN);
the prefill worker, before its next step, stops (YIELDING) until that decode step is done, and
before any step waits for a decode step in progress to end (`take_prefill_turn`), so the two
never run at once on the same cores; past its stall cap a decode worker steps regardless (see
`stall_cap` and `turn_after`: under SLO control both follow the coordinator's TPOT target). A
prefill worker sizes its threads by the busy prefill workers alone. Time to first token is what
a backed-up prefill queue costs, and each prompt's whole prefill waits on it, while a decode
stream loses at most the cap per token (docs/performance.md, "Figures behind design choices":
a static 1 + 1 split doubled a burst's prefill time).

Lifecycle: the launcher calls `create_share(n_workers)` once (a file of one byte per worker in
/dev/shm) and hands worker i the spec "PATH:i" (`--core-share`); it unlinks the file when it
stops. A worker builds `CoreShare.open(spec, cores)`, calls `busy()` before each step it is
about to run and `idle()` before it waits for work (`size_alone()` first, before its model loads), runs its start-up profile in `alone()`
(one worker's profile at a time), and `close()` (idle) on exit. It hands the share to its
engine (`LLMEngine.core_share`), which logs the steps run on fewer threads because busy workers
of its own role share the cores (`role_share`) apart for the coordinator. A worker
started without a spec gets `StaticCores`, whose calls do nothing: it keeps the thread count it
was given. A worker killed while busy leaves
its byte set until it (or its replacement in the same slot) starts again: the others run on
fewer threads meanwhile, never more, so the failure mode is slow, not oversubscribed.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import tempfile
import time

import torch

from pdserve.common.core_turns import DECODE_STALL_CAP_S, stall_cap, turn_after  # noqa: F401  (stall_cap: worker/any_role.py's import)

log = logging.getLogger("pdserve.cores")


def create_share(num_workers: int, directory: str | None = None) -> str:
    """Create the shared busy flags for num_workers workers; returns the file's path."""
    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix="pdserve-cores-", dir=directory)
    try:
        os.write(fd, bytes(max(1, num_workers)))
    finally:
        os.close(fd)
    return path


PREFILL_YIELD_LIMIT_S = 1.0  # a prefill worker waits at most this long for a decode worker's turn
PROFILE_WAIT_LIMIT_S = 60.0  # a worker waits at most this long for another's start-up profile (alone)


# one byte per worker: what it is doing now
IDLE, DECODING, PREFILLING, WANTS_TURN, YIELDING = 0, 1, 2, 3, 4
BUSY = (DECODING, PREFILLING)  # the flags that hold cores (a worker's thread count divides them)


class CoreShare:
    def __init__(self, path: str, slot: int, cores: int):
        self.cores = max(1, cores)
        with open(path, "r+b") as f:
            self.flags = mmap.mmap(f.fileno(), 0)
        if not 0 <= slot < len(self.flags):
            raise ValueError(f"core-share slot {slot} outside the {len(self.flags)} workers of {path}")
        self.slot = slot
        self.path = path
        self.threads = torch.get_num_threads()
        # the threads of the step about to run where fewer than every core because busy workers of
        # its own role share them (0: every core, or fewer beside a busy prefill worker: the
        # coordinator models that as turns); the engine logs such a step apart (LLMEngine.core_share)
        self.role_share = 0
        self.flags[slot] = IDLE

    @classmethod
    def open(cls, spec: str | None, cores: int | None = None) -> CoreShare | StaticCores:
        """From a "PATH:SLOT" spec; without one, StaticCores (the worker keeps its threads)."""
        if not spec:
            return StaticCores()
        path, _, slot = spec.rpartition(":")
        if not path or not slot.isdigit():
            raise ValueError(f"--core-share must be PATH:SLOT, got {spec!r}")
        return cls(path, int(slot), cores or os.cpu_count() or 1)

    def size_alone(self) -> None:
        """Before the model loads: torch's threads = every core, what this worker runs on when it
        is the node's only busy one (most of its steps), so that its linear back-ends are chosen
        (kernels/select.py: the table is measured and cached per thread count) for that count,
        not for the --threads share the launcher passes (measured: the decode worker of a 1 + 1
        launch chose its table at 1 thread, and its steps then ran on 2)."""
        torch.set_num_threads(self.cores)
        self.threads = self.cores

    def busy_workers(self, flags: bytes | None = None) -> int:
        flags = self.flags[:] if flags is None else flags
        return max(1, sum(flags.count(f) for f in BUSY))

    def busy(self, prefill: bool = False) -> int:
        """Mark this worker busy (a prefill worker says so) and size its thread pool for the busy
        workers; returns threads."""
        self.flags[self.slot] = PREFILLING if prefill else DECODING
        # a prefill worker shares the cores with the other busy prefill workers only: decode
        # workers defer to it (defer_to_prefill) and step in its turns (take_prefill_turn)
        flags = self.flags[:]
        sharing = flags.count(PREFILLING) if prefill else self.busy_workers(flags)  # one read of the flags a step
        threads = max(1, self.cores // max(1, sharing))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        beside_prefill = not prefill and flags.count(PREFILLING) > 0
        self.role_share = threads if threads < self.cores and not beside_prefill else 0
        return threads

    def idle(self) -> None:
        self.flags[self.slot] = IDLE

    @contextlib.contextmanager
    def alone(self, limit_s: float = PROFILE_WAIT_LIMIT_S):
        """Busy, with no other worker of the launch in an `alone` block meanwhile (an exclusive
        lock on the share file, waited for at most limit_s; the kernel drops it if the process
        dies): the start-up profiles,
        whose timings seed the coordinator's latency models, then each measure a step on every
        core as served, not two workers' profiles at once on half the cores each (measured: the
        prefill worker's model then put a 32-prompt burst's 13th prompt at 4.3 s and shed it,
        while the 11 it kept had a p99 TTFT of 2.5 s)."""
        with open(self.path, "rb") as f:
            deadline = time.monotonic() + limit_s
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:  # a worker hung in its profile: go on, timings shared
                        log.warning("core share %s: another worker's start-up profile held the cores for %.0f s; profiling anyway",
                                    self.path, limit_s)
                        break
                    time.sleep(0.01)
            try:
                self.busy()
                yield
            finally:
                self.idle()
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _others(self) -> bytes:
        """The other workers' flags."""
        flags = self.flags[:]
        return flags[:self.slot] + flags[self.slot + 1:]

    def defer_to_prefill(self, since_last_step: float, cap: float = DECODE_STALL_CAP_S) -> bool:
        """Whether a decode worker should hold its next step (it is then marked idle, or, past
        turn_after(cap), as wanting a turn): a prefill worker of the node is busy, this worker
        stepped less than `cap` seconds ago (stall_cap), and no prefill worker has yielded it a
        turn. Past the cap it steps whatever the prefill workers do."""
        others = self._others()
        if PREFILLING not in others and (YIELDING not in others or self.flags[self.slot] == WANTS_TURN):
            return False  # no prefill runs, or the one that ran has stopped for this worker's turn
        if since_last_step >= cap:
            return False
        self.flags[self.slot] = WANTS_TURN if since_last_step >= turn_after(cap) else IDLE
        return True

    def take_prefill_turn(self, limit_s: float = PREFILL_YIELD_LIMIT_S) -> int:
        """A prefill worker, before each step: first let a decode worker that wants a turn take
        one step on every core (marked YIELDING meanwhile), and let a decode step in progress
        end (marked PREFILLING, so that no other begins), at most limit_s; then busy(prefill=True).
        Steps of the two never overlap on the cores, so neither's OpenMP barriers wait on threads
        the other preempted."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            others = self._others()
            if WANTS_TURN in others or (self.flags[self.slot] == YIELDING and DECODING in others):
                self.flags[self.slot] = YIELDING
            elif DECODING in others:
                self.flags[self.slot] = PREFILLING
            else:
                break
            time.sleep(0.001)
        return self.busy(prefill=True)

    def close(self) -> None:
        if not self.flags.closed:
            self.idle()
            self.flags.close()


class StaticCores:
    """The no-op share of a worker started without --core-share."""

    role_share = 0  # its steps all run on the threads it was given

    def size_alone(self) -> None:
        pass

    def busy(self, prefill: bool = False) -> int:
        return torch.get_num_threads()

    def idle(self) -> None:
        pass

    @contextlib.contextmanager
    def alone(self, limit_s: float = 0.0):
        yield

    def defer_to_prefill(self, since_last_step: float, cap: float = DECODE_STALL_CAP_S) -> bool:
        return False

    def take_prefill_turn(self, limit_s: float = PREFILL_YIELD_LIMIT_S) -> int:
        return self.busy(prefill=True)

    def close(self) -> None:
        pass
