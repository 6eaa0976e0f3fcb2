"""Grammar compiles off the caller's thread, with a time budget and a bounded cache of outcomes.

Lifecycle: a `CompileLane` owns `threads` daemon threads (one in a worker: a runaway compile
takes at most one core; xgrammar releases the GIL while it compiles, so the batch step runs on)
and an `LRU` of outcomes (a compiled value, or the typed error that refused it), bounded by
count and by bytes. `submit(key)` answers a cached outcome at once, joins a compile of the same
key already queued or running, or queues a new one; `outcome(job)` is polled (never blocks): the
value, None while the compile may still finish in budget, or it raises the typed error:
`GrammarTooComplex` (limit_exceeded) once the compile has run past the budget (its late result
or its probe's refusal is cached as that refusal, so a repeat is refused at once) or
`CompilerBusy` (overloaded) for a job queued behind compiles that are all past their budget (and,
with a probe, its margin). With a `probe` (the workers'), each new key first compiles in a killable
helper process (`Probe`, below) that is stopped at the budget, so a runaway frees the thread within
budget + ~0 s; the compile on the thread then gets a budget of its own. Without one (the gateway's
checks, which only parse), a runaway's thread runs on.
`release(job)` says a waiter gave up (refused, aborted, disconnected); a job nobody waits for
is skipped if it has not started. The budget counts from the start of the compile itself, after
`prepare` (a first compile's imports and tokenizer tables: seconds, once). Torch-free: the
gateway imports it.
"""
from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

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
    def __init__(self, compile, threads: int, cache: LRU, budget_ms: float = MAX_COMPILE_MS, prepare=None, name: str = "grammar",
                 probe=None):
        self.compile = compile  # key -> value; raises a PdserveError naming what is wrong with the spec
        self.prepare = prepare  # key -> None: set-up outside the budget (imports, tokenizer tables)
        # (key, budget_s) -> True if a killable twin of the compile (a `Probe`) finished in budget_s, False if it
        # was stopped there; raises a PdserveError for a wrong spec. The compile then gets a budget of its own.
        self.probe = probe
        self.grace_s = Probe.MARGIN_S if probe is not None else 0.0  # a probed job frees its thread by then past its budget
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
            if job.started is not None:
                return max(0.001, job.started + self.budget_s - now)
            starts = [j.started for j in self.jobs.values() if j.started is not None]
        return max(0.001, min((s + self.budget_s + self.grace_s - now for s in starts), default=self.budget_s))

    def _overdue(self, now: float) -> int:
        with self.lock:
            return sum(1 for j in self.jobs.values() if j.started is not None and now - j.started > self.budget_s + self.grace_s)

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
            if self.probe is not None:
                if not self.probe(job.key, self.budget_s):
                    raise self._too_complex()
                with self.lock:
                    job.started = time.monotonic()  # in budget there: the compile itself takes about as long
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


# ---------------------------------------------------------------------- the killable probe
# A compile in a thread cannot be stopped (xgrammar's C++ runs on, holding the lane's one thread and
# a core), and a compiled grammar cannot be passed back from another process (xgrammar's JSON of a
# 12 MB grammar is 700 MB, a minute to write). So each new spec compiles first in a probe: a helper
# process (started once, outside the budget) forks a child per spec that compiles it and reports
# only "ok" or the error's text; past the budget the helper kills the child. The lane's thread then
# compiles only a spec the probe compiled in budget (so at most about the budget again), and a
# runaway holds nothing past its budget. Frames: a 4-byte length and msgpack (msgspec), no pickle.

def _send(f, obj) -> None:
    data = msgspec.msgpack.encode(obj)
    f.write(len(data).to_bytes(4, "big") + data)
    f.flush()


def _recv(f):
    head = f.read(4)
    if len(head) < 4:
        raise EOFError("the grammar probe closed its pipe")
    return msgspec.msgpack.decode(f.read(int.from_bytes(head, "big")))


def serve_probes(make_compile) -> None:
    """The helper process's loop: stdin's first frame builds `compile = make_compile(frame)`; each
    next frame [budget_s, request] is compiled by a forked child; the answer is [status, text]:
    ok, invalid (a PdserveError's text: the spec is wrong), timeout, or failed."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compile = make_compile(_recv(stdin))
    _send(stdout, ["ready", ""])
    while True:
        try:
            budget_s, request = _recv(stdin)
        except EOFError:
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compile, answer, exit without running the parent's clean-up
            os.close(r)
            try:
                compile(request)
                answer = ["ok", ""]
            except PdserveError as e:
                answer = ["invalid", str(e)]
            except BaseException as e:  # noqa: BLE001
                answer = ["failed", str(e)]
            with os.fdopen(w, "wb") as out:
                _send(out, answer)
            os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], budget_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)  # our own unreaped child: its pid cannot have been reused
        with os.fdopen(r, "rb") as inp:
            try:
                answer = _recv(inp) if ready else ["timeout", ""]
            except (EOFError, msgspec.DecodeError):
                answer = ["failed", "the grammar probe's child died"]
        os.waitpid(pid, 0)
        _send(stdout, answer)


class Probe:
    """The parent's side: `start(init)` once (outside the budget), then `run(request, budget_s)`
    answers [status, text] in at most budget_s + MARGIN_S (a helper that does not is killed and
    started again on the next `start`)."""

    MARGIN_S = 1.0

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.init = None

    def start(self, init) -> None:
        if self.proc is not None and self.proc.poll() is None and self.init is init:
            return
        self.close()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.init = init
        _send(self.proc.stdin, init)
        if _recv(self.proc.stdout)[0] != "ready":
            raise RuntimeError("the grammar probe did not start")

    def run(self, request, budget_s: float) -> list:
        proc = self.proc
        try:
            _send(proc.stdin, [budget_s, request])
            ready, _, _ = select.select([proc.stdout], [], [], budget_s + self.MARGIN_S)
            if ready:
                return _recv(proc.stdout)
        except (OSError, EOFError, msgspec.DecodeError):
            pass
        self.close()  # stuck or dead: a fresh one on the next start
        return ["failed", "the grammar probe did not answer"]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
