"""Grammar compiles off the caller's thread, with a time budget and a bounded cache of outcomes.

Lifecycle: a `CompileLane` owns `threads` daemon threads (one in a worker: a runaway compile
takes at most one core; xgrammar releases the GIL while it compiles, so the batch step runs on)
and an `LRU` of outcomes (a compiled value, or the typed error that refused it), bounded by
count and by bytes. `submit(key)` answers a cached outcome at once, joins a compile of the same
key already queued or running, or queues a new one; `outcome(job)` is polled (never blocks): the
value, None while the compile may still finish in budget, or it raises the typed error:
`GrammarTooComplex` (limit_exceeded) once the compile has run past the budget (the thread runs
on, its late result is cached as that refusal so a repeat is refused at once) or
`CompilerBusy` (overloaded) for a job queued behind compiles that are all past their budget.
`release(job)` says a waiter gave up (refused, aborted, disconnected); a job nobody waits for
is skipped if it has not started. The budget counts from the start of the compile itself, after
`prepare` (a first compile's imports and tokenizer tables: seconds, once). Torch-free: the
gateway imports it.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.common.errors import LimitExceededError
from pdserve_client.errors import PdserveError

MAX_COMPILE_MS = 5000  # a grammar that takes longer to compile is refused (limit_exceeded)


class GrammarTooComplex(LimitExceededError):
    """A structured-output spec whose grammar did not compile within the budget."""


class CompilerBusy(PdserveError):
    """Every grammar compile thread is held by a compile past its budget; retry later."""

    code = "overloaded"


class LRU:
    """A least-recently-used map bounded by entries and by bytes (`size(key, value)` each)."""

    def __init__(self, entries: int, nbytes: int, size):
        self.entries, self.nbytes, self.size = entries, nbytes, size
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key):
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key][0]

    def put(self, key, value) -> None:
        self.pop(key)
        n = self.size(key, value)
        if n > self.nbytes:
            return  # larger than the whole cache: not kept
        self.items[key] = (value, n)
        self.bytes += n
        while len(self.items) > self.entries or self.bytes > self.nbytes:
            self.pop(next(iter(self.items)))

    def pop(self, key) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.bytes -= item[1]

    def clear(self) -> None:
        self.items.clear()
        self.bytes = 0


class CompileJob:
    __slots__ = ("key", "future", "started", "waiters")

    def __init__(self, key):
        self.key = key
        self.future: Future = Future()  # result: (value, error); set by the lane only, never cancelled
        self.started: float | None = None  # monotonic time the compile itself began
        self.waiters = 1


class CompileLane:
    def __init__(self, compile, threads: int, cache: LRU, budget_ms: float = MAX_COMPILE_MS, prepare=None, name: str = "grammar"):
        self.compile = compile  # key -> value; raises a PdserveError naming what is wrong with the spec
        self.prepare = prepare  # key -> None: set-up outside the budget (imports, tokenizer tables)
        self.threads = threads
        self.cache = cache
        self.budget_ms = budget_ms
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.jobs: dict = {}  # key -> CompileJob queued or running
        self.lock = threading.Lock()

    @property
    def budget_s(self) -> float:
        return self.budget_ms / 1000

    def submit(self, key) -> CompileJob:
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                job = CompileJob(key)
                job.future.set_result(hit)
                return job
            job = self.jobs.get(key)
            if job is not None:
                job.waiters += 1
                return job
            job = self.jobs[key] = CompileJob(key)
        self.pool.submit(self._run, job)
        return job

    def release(self, job: CompileJob) -> None:
        with self.lock:
            job.waiters -= 1
            if job.waiters <= 0 and job.started is None and self.jobs.get(job.key) is job:
                del self.jobs[job.key]  # not started: _run skips it

    def outcome(self, job: CompileJob, now: float | None = None):
        """The compiled value; None while it may still finish in budget; else raises the typed error."""
        if job.future.done():
            value, error = job.future.result()
            if error is not None:
                raise type(error)(str(error))
            return value
        now = time.monotonic() if now is None else now
        started = job.started
        if started is not None and now - started > self.budget_s:
            raise self._too_complex()
        if started is None and self._overdue(now) >= self.threads:
            raise CompilerBusy(f"every grammar compile thread is held by a grammar past its {self.budget_ms:.0f} ms budget; retry later")
        return None

    def next_check(self, job: CompileJob, now: float | None = None) -> float:
        """Seconds until `outcome(job)` could change without the job finishing (at least 1 ms)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            starts = [job.started] if job.started is not None else [j.started for j in self.jobs.values() if j.started is not None]
        return max(0.001, min((s + self.budget_s - now for s in starts), default=self.budget_s))

    def _overdue(self, now: float) -> int:
        with self.lock:
            return sum(1 for j in self.jobs.values() if j.started is not None and now - j.started > self.budget_s)

    def _too_complex(self) -> GrammarTooComplex:
        return GrammarTooComplex(f"the structured output grammar did not compile within the server's "
                                 f"{self.budget_ms:.0f} ms budget; simplify the schema or pattern")

    def _run(self, job: CompileJob) -> None:
        with self.lock:
            if self.jobs.get(job.key) is not job:
                return  # every waiter gave up before it started
        try:
            if self.prepare is not None:
                self.prepare(job.key)
            with self.lock:
                job.started = time.monotonic()
            value, error = self.compile(job.key), None
            if time.monotonic() - job.started > self.budget_s:
                value, error = None, self._too_complex()  # its waiters were refused already; so is a repeat
        except PdserveError as e:
            value, error = None, e
        except Exception as e:  # noqa: BLE001 - a waiter must always get an answer
            value, error = None, PdserveError(f"grammar compile failed: {e}")
        with self.lock:
            if self.jobs.get(job.key) is job:
                del self.jobs[job.key]
            if type(error) is not PdserveError:  # an internal failure is not remembered
                self.cache.put(job.key, (value, error))
        job.future.set_result((value, error))
