"""Request bodies in flight: the gateway-wide budget of their bytes, and the bounded, timed read
every route with a body starts with.

Why: a body is held whole before it is decoded, so without a bound 64 clients that each send
8 MiB - 1 byte and stall held 615 MiB of the gateway, for as long as they liked.

Lifecycle: the gateway makes one `BodyBudget` (GatewayConfig.body_budget_bytes) and every request
with a body reads it through `BodyBudget.read(request, limit, timeout_s)`, an async context
manager that
- refuses a declared Content-Length over `limit` with 413 at once (a body without one is refused
  as soon as it passes the limit);
- reserves the body's bytes from the budget (its Content-Length; without one, `limit`) before
  reading any: a body of at most FREE_BODY_BYTES reserves nothing (uvicorn buffers that much of
  any connection anyway), a larger one waits its turn in arrival order while the budget is spent.
  Waiting holds no body bytes: uvicorn stops reading a connection whose app does not receive
  past 64 KiB, and the kernel's socket buffers hold the rest. A burst of honest large bodies is
  served in order rather than refused;
- bounds the wait and the read by `timeout_s` each: a body still waiting for room after it is
  answered 503 (server_busy, with Retry-After: the server was slow, not the client; uvicorn then
  reads and drops the rest of the body, so the client sees the answer), a body still incomplete
  `timeout_s` after its read began is answered 408 (body_read_timeout) with `Connection: close`,
  so uvicorn closes the connection and drops what it held;
- yields the body and gives its reservation back when the block ends (after its decode: the
  parse lane's queue holds reserved bodies, so it is bounded in bytes by the budget too);
- once no large body is held and at least TRIM_AFTER_BYTES were reserved since the last time,
  hands the freed heap back to the system (glibc's malloc_trim, on a thread: ~10 ms for 128 MiB).
  A body arrives as 64 KiB chunks, below malloc's mmap threshold, so they come from the heap
  between the small objects that outlive them; freed, they stayed in the gateway's RSS (CI: +129 MiB
  for good after 64 stalled 8 MiB bodies; tests/gateway/test_body_budget.py measures the return).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import time

from pdserve.gateway.errors import MAX_BODY_BYTES, ApiError

FREE_BODY_BYTES = 64 * 1024  # a body this small reserves nothing: uvicorn's own per-connection buffer (its HIGH_WATER_LIMIT)
TRIM_AFTER_BYTES = 16 * 2**20  # large bodies' bytes reserved since the last trim that make the next idle moment trim


def _libc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _libc_trim()


def give_heap_back() -> None:
    """Return the free pages of every malloc arena to the system (a no-op without glibc)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


class BodyBudget:
    """Bytes of request bodies larger than FREE_BODY_BYTES held at once, at most `budget` (>= one
    largest body); reservations are granted in arrival order."""

    def __init__(self, budget: int, retry_after_s: int = 1):
        self.budget = budget
        self.retry_after_s = retry_after_s
        self.held = 0  # bytes reserved by bodies being read or decoded
        self.since_trim = 0  # bytes reserved since the heap was last given back
        self.trims = 0  # times it was (for tests and stats)
        self.waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @contextlib.asynccontextmanager
    async def read(self, request, limit: int = MAX_BODY_BYTES, timeout_s: float = 30.0):
        """The request's body (see the module's docstring); its bytes stay reserved inside the block."""
        size = request.headers.get("content-length", "")
        declared = int(size) if size.isdigit() else None
        if declared is not None and declared > limit:
            raise too_large(limit)
        need = limit if declared is None else 0 if declared <= FREE_BODY_BYTES else declared
        await self.reserve(need, time.monotonic() + timeout_s)
        try:
            yield await read_body(request, limit, time.monotonic() + timeout_s)
        finally:
            self.release(need)

    async def reserve(self, need: int, deadline: float) -> None:
        """Wait (in arrival order) until `need` bytes fit in the budget; 503 once the deadline passes."""
        if need == 0:
            return
        self.since_trim += need
        if not self.waiting and self.held + need <= self.budget:
            self.held += need
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append((need, turn))
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await turn  # granted: release() counted it in self.held
        except TimeoutError:
            if not _granted(turn):  # (granted in the instant the deadline passed: it goes on)
                raise ApiError(503, f"the gateway holds its budget of request body bytes ({self.budget >> 20} MiB) and this "
                                    "body waited its whole read timeout for room; retry", "server_busy",
                               headers={"Retry-After": str(self.retry_after_s)}) from None
        except BaseException:  # its request was cancelled (the client left)
            if _granted(turn):
                self.release(need)
            raise
        finally:
            with contextlib.suppress(ValueError):
                self.waiting.remove((need, turn))

    def release(self, need: int) -> None:
        """Give `need` bytes back and grant the waiting reservations that now fit, in order."""
        self.held -= need
        while self.waiting:
            first, turn = self.waiting[0]
            if turn.done():  # its waiter gave up
                self.waiting.popleft()
                continue
            if self.held + first > self.budget:
                break
            self.waiting.popleft()
            self.held += first
            turn.set_result(None)
        if self.held == 0 and self.since_trim >= TRIM_AFTER_BYTES:
            self.since_trim = 0
            self.trims += 1
            asyncio.get_running_loop().run_in_executor(None, give_heap_back)


def _granted(turn: asyncio.Future) -> bool:
    return turn.done() and not turn.cancelled()


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the limit of {limit} bytes", "request_too_large")


async def read_body(request, limit: int = MAX_BODY_BYTES, deadline: float | None = None) -> bytes:
    """The request body, refused with 413 once it passes `limit` bytes (it is never held whole) and
    with 408 (and the connection closed) if it has not arrived whole by `deadline` (time.monotonic())."""
    chunks, n = [], 0
    try:
        async with asyncio.timeout_at(None if deadline is None else _loop_time(deadline)):
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive whole in time ({n} bytes came)", "body_read_timeout",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)
