"""The gateway's in-flight coordinator requests, shared fairly between HTTP requests.

Lifecycle: the gateway makes one `Slots` (`--max-inflight`, kept at or under the coordinator's
per-client bound, since the gateway is one client). Each HTTP request takes a `Lease` for its
life: a choice (one coordinator request) runs only while it holds a slot, given back when the
choice ends. A lease may hold at most `share()` = total // (HTTP requests with a lease + 1)
slots, so one body with n x a batch of prompts never takes them all: there is always room for
the next caller, and a big body's later choices start as its earlier ones end. A request that
cannot start even one choice (every slot held) is refused at once (429); the choices beyond a
request's share wait in the gateway, never at the coordinator.
"""
from __future__ import annotations

import asyncio


class Slots:
    def __init__(self, total: int):
        self.total = total
        self.held = 0
        self.leases = 0
        self._waiters: list[asyncio.Future] = []

    def share(self) -> int:
        return max(1, self.total // (self.leases + 1))

    def lease(self) -> Lease:
        self.leases += 1
        return Lease(self)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)


class Lease:
    def __init__(self, slots: Slots):
        self.slots = slots
        self.held = 0
        self.closed = False

    def try_take(self) -> bool:
        s = self.slots
        if self.held >= s.share() or s.held >= s.total:
            return False
        self.held += 1
        s.held += 1
        return True

    async def take(self) -> None:
        """Wait until this lease may hold one more slot, and take it."""
        while not self.try_take():
            fut = asyncio.get_running_loop().create_future()
            self.slots._waiters.append(fut)
            await fut

    def give(self) -> None:
        self.held -= 1
        self.slots.held -= 1
        self.slots._wake()

    def close(self) -> None:
        """The HTTP request is done; its slots must already be given back."""
        if not self.closed:
            self.closed = True
            self.slots.leases -= 1
            self.slots._wake()  # the others' share grew
