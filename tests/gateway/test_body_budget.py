"""The gateway's bounds on request bodies in flight, in-process (gateway/bodies.py, gateway/parse_lane.py):
the body budget (small bodies free, large ones reserved and granted in arrival order, a wait past
the deadline a 503 with Retry-After, a cancelled waiter leaving nothing held), the read deadline
(a stalled body a 408 that closes the connection, its bytes given back), 413 before reading a
declared length over the limit, and the parse lane's queue (one body past it a 503)."""
import asyncio
import threading
import time

import pytest

from pdserve.gateway.bodies import FREE_BODY_BYTES, BodyBudget
from pdserve.gateway.errors import ApiError
from pdserve.gateway.parse_lane import INLINE_BYTES, ParseLane, _Reply
from pdserve.wire.limits import RequestLimits

LARGE = 100_000  # > FREE_BODY_BYTES: reserved
LIMIT = 1_000_000


class Body:
    """A request whose body arrives in two halves; the second once `rest` is set (never, for a stalled one)."""

    def __init__(self, size: int, declared: bool = True):
        self.headers = {"content-length": str(size)} if declared else {}
        self.size = size
        self.rest = asyncio.Event()
        self.started = asyncio.Event()  # its read began: its bytes are reserved

    async def stream(self):
        self.started.set()
        yield b"x" * (self.size // 2)
        await self.rest.wait()
        yield b"x" * (self.size - self.size // 2)


async def read(budget: BodyBudget, req: Body, timeout_s: float = 30.0, hold: asyncio.Event | None = None) -> int:
    async with budget.read(req, LIMIT, timeout_s) as body:
        if hold is not None:
            await hold.wait()  # decoding: the bytes stay reserved
        return len(body)


def test_small_bodies_pass_free_and_large_ones_are_granted_in_arrival_order():
    async def run():
        budget = BodyBudget(2 * LARGE)
        a, b, c, d = Body(LARGE), Body(LARGE), Body(LARGE), Body(FREE_BODY_BYTES)
        hold_a = asyncio.Event()
        ta = asyncio.create_task(read(budget, a, hold=hold_a))
        tb = asyncio.create_task(read(budget, b))
        tc = asyncio.create_task(read(budget, c))
        await asyncio.wait_for(asyncio.gather(a.started.wait(), b.started.wait()), 5)
        assert budget.held == 2 * LARGE and len(budget.waiting) == 1 and not c.started.is_set()
        d.rest.set()
        assert await asyncio.wait_for(read(budget, d), 5) == FREE_BODY_BYTES  # never waits
        a.rest.set()
        b.rest.set()
        assert await asyncio.wait_for(tb, 5) == LARGE  # b's bytes back: c reads
        await asyncio.wait_for(c.started.wait(), 5)
        assert budget.held == 2 * LARGE  # a (still decoding) and c
        hold_a.set()
        c.rest.set()
        assert await asyncio.wait_for(asyncio.gather(ta, tc), 5) == [LARGE, LARGE]
        assert budget.held == 0 and not budget.waiting
    asyncio.run(run())


def test_a_stalled_body_is_a_408_that_closes_the_connection_and_gives_its_bytes_back():
    async def run():
        budget = BodyBudget(2 * LARGE)
        t0 = time.monotonic()
        with pytest.raises(ApiError) as e:
            await read(budget, Body(LARGE), timeout_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
        assert (e.value.status, e.value.code, e.value.headers) == (408, "body_read_timeout", {"Connection": "close"})
        assert budget.held == 0
    asyncio.run(run())


def test_a_body_waiting_for_room_past_its_deadline_is_a_503_and_a_cancelled_waiter_leaves_nothing():
    async def run():
        budget = BodyBudget(LARGE, retry_after_s=3)
        first = Body(LARGE)
        holder = asyncio.create_task(read(budget, first))
        await asyncio.wait_for(first.started.wait(), 5)
        with pytest.raises(ApiError) as e:
            await read(budget, Body(LARGE), timeout_s=0.2)
        assert (e.value.status, e.value.code, e.value.headers) == (503, "server_busy", {"Retry-After": "3"})
        gone = asyncio.create_task(read(budget, Body(LARGE)))  # its client leaves while it waits
        await asyncio.sleep(0)
        assert len(budget.waiting) == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        first.rest.set()
        assert await asyncio.wait_for(holder, 5) == LARGE
        assert budget.held == 0 and not budget.waiting
    asyncio.run(run())


def test_a_declared_length_over_the_limit_is_a_413_before_any_byte_is_read_and_a_chunked_one_once_past_it():
    async def run():
        budget = BodyBudget(2 * LIMIT)
        over = Body(LIMIT + 1)
        with pytest.raises(ApiError) as e:
            await read(budget, over)
        assert e.value.status == 413 and not over.started.is_set()
        chunked = Body(LIMIT + 1, declared=False)  # reserves the whole limit, refused as it passes it
        chunked.rest.set()
        with pytest.raises(ApiError) as e:
            await read(budget, chunked)
        assert e.value.status == 413 and budget.held == 0
    asyncio.run(run())


def test_the_parse_lane_refuses_a_body_past_its_queue_with_a_503():
    async def run():
        lane = ParseLane(RequestLimits(), max_queued=1, retry_after_s=2)
        go = threading.Event()
        lane._round_trip = lambda job: go.wait(10) and _Reply(status=400, message="refused in the child", code="c")
        body = b" " * (INLINE_BYTES + 1)
        try:
            first = asyncio.create_task(lane.parse(body, "ChatCompletionRequest"))
            await asyncio.sleep(0)  # it is queued
            with pytest.raises(ApiError) as e:
                await lane.parse(body, "ChatCompletionRequest")
            assert (e.value.status, e.value.code, e.value.headers) == (503, "parser_busy", {"Retry-After": "2"})
            go.set()
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(first, 10)
            assert (e.value.status, e.value.message) == (400, "refused in the child") and lane.queued == 0
        finally:
            lane.close()
    asyncio.run(run())


class Chunked:
    """A request whose body arrives as 64 KiB chunks, as uvicorn hands them on, while the server
    makes small objects that outlive it (what pinned the freed chunks in the heap)."""

    def __init__(self, size: int, keep: list):
        self.headers = {"content-length": str(size)}
        self.size, self.keep = size, keep

    async def stream(self):
        for i in range(0, self.size, 64 * 1024):
            self.keep.append(bytes(600 + i % 7))  # over pymalloc's 512 bytes: from malloc
            yield bytes(min(64 * 1024, self.size - i))
            await asyncio.sleep(0)


def test_the_heap_goes_back_once_large_bodies_are_gone():
    """16 bodies of 8 MiB held at once (the budget's 128 MiB): once they are read and released the
    budget trims the heap and the process's RSS comes back within 24 MiB of where it began (without
    the trim it stayed ~128 MiB higher: CI's gateway after 64 stalled bodies)."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    keep: list = []

    async def main(budget: BodyBudget) -> int:
        async def one():
            async with budget.read(Chunked(8 * 2**20, keep), 10 * 2**20, 30.0) as body:
                await asyncio.sleep(0.05)  # all 16 held at once
                return len(body)
        sizes = await asyncio.gather(*(one() for _ in range(16)))
        await asyncio.sleep(0.1)
        return sum(sizes)

    budget = BodyBudget(128 * 2**20)
    before = rss()
    start = time.monotonic()
    assert asyncio.run(main(budget)) == 16 * 8 * 2**20
    poll_until = start + 10
    while rss() - before > 24 * 2**20 and time.monotonic() < poll_until:
        time.sleep(0.05)
    assert budget.held == 0
    assert rss() - before <= 24 * 2**20, f"RSS {(rss() - before) / 2**20:.0f} MiB above the start ({budget.trims} trims)"
