"""Cold starts: requests held while a model has no worker that can decode, and the time its
workers took to come back, measured (the coordinator's `--cold-start-s` is only the estimate until
a cold start has been measured).

Lifecycle: one `ColdStarts` per coordinator, built from its config when cold starts are on
(`--cold-start-s` > 0: an orchestrator starts workers on demand, `pdserve launch --ray` with
--min-replicas 0). A request that finds no worker able to decode is `hold`-ed: taken unless the
held-requests bound (count, prompt bytes) is full, and the first hold of a cold start starts its
clock. When a worker that can decode registers (`registered`), the clock stops: the time from the
first hold to that registration is one measured cold start (the last MEASURED_KEPT kept; their
mean is `expected_s`, what a refusal's Retry-After says), and every held request is released
(`release`: its wait is over; the coordinator places it and counts its TTFT target from then). The
first token of the first request released after a cold start gives the cold start's time to a first
token (`first_token`). A request that ends while held (placed, errored, timed out) is `forget`-ten.
Pure bookkeeping: no sockets, no clock of its own (every call is given `now`).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

MEASURED_KEPT = 8  # cold starts whose times are kept (their mean is the expected one)
TOKEN_BYTES = 4  # a held prompt's bytes: its token ids at this many bytes each (what the coordinator keeps of it)


@dataclass
class ColdStarts:
    estimate_s: float  # --cold-start-s: the expected cold start until one is measured
    timeout_s: float  # --cold-start-timeout-s: a held request waits at most this long
    max_held: int  # --max-held-requests
    max_held_bytes: int  # --max-held-kb, in bytes
    started: float | None = None  # the first hold of the cold start under way (None: none under way)
    held: dict = field(default_factory=dict)  # request id -> its prompt bytes, while it waits for a worker
    to_registered: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MEASURED_KEPT))
    to_first_token: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MEASURED_KEPT))
    first_of: tuple | None = None  # (request id, when its cold start began) of the first request a cold start released

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())

    def expected_s(self) -> float:
        """The cold start to expect: the mean of the measured ones, else the estimate."""
        return sum(self.to_registered) / len(self.to_registered) if self.to_registered else self.estimate_s

    def hold(self, iid: str, prompt_tokens: int, now: float, bounded: bool = True) -> str | None:
        """Hold request iid (a prompt of `prompt_tokens` tokens) until a worker registers; the
        reason it cannot be held (a bound full) instead, or None once held. bounded=False: held
        whatever the bounds (a request already served once, placed again after its worker was lost:
        refusing it would end a stream the client has begun to read)."""
        nbytes = prompt_tokens * TOKEN_BYTES
        if bounded and len(self.held) >= self.max_held:
            return f"{len(self.held)} requests wait for a cold start (--max-held-requests {self.max_held})"
        if bounded and self.held_bytes + nbytes > self.max_held_bytes:
            return (f"the requests that wait for a cold start hold {self.held_bytes} bytes of prompts, with this one's {nbytes} over "
                    f"--max-held-kb {self.max_held_bytes // 1024}")
        self.held[iid] = nbytes
        if self.started is None:
            self.started = now
        return None

    def registered(self, now: float) -> list[str]:
        """A worker that can decode registered: the cold start under way (if any) is measured and
        over. Returns the held requests, released (their wait ends now)."""
        released = list(self.held)
        if self.started is not None:
            self.to_registered.append(now - self.started)
            if released:
                self.first_of = (released[0], self.started)
            self.started = None
        self.held.clear()
        return released

    def forget(self, iid: str) -> None:
        """Request iid no longer waits (it ended while held)."""
        self.held.pop(iid, None)
        if not self.held and self.started is not None:
            self.started = None  # nobody waits: no cold start is being measured

    def first_token(self, iid: str, now: float) -> None:
        """Request iid's first token: the cold start that released it first is measured to here."""
        if self.first_of is not None and self.first_of[0] == iid:
            self.to_first_token.append(now - self.first_of[1])
            self.first_of = None

    def summary(self) -> dict:
        """The stats' `cold_start`: the estimate, what was measured (seconds) and what waits now."""
        def mean(xs):
            return round(sum(xs) / len(xs), 3) if xs else None

        return {"estimate_s": self.estimate_s, "expected_s": round(self.expected_s(), 3), "measured": len(self.to_registered),
                "to_registered_s": [round(x, 3) for x in self.to_registered], "to_registered_mean_s": mean(self.to_registered),
                "to_first_token_s": [round(x, 3) for x in self.to_first_token], "to_first_token_mean_s": mean(self.to_first_token),
                "timeout_s": self.timeout_s, "held": len(self.held), "held_bytes": self.held_bytes, "max_held": self.max_held,
                "max_held_bytes": self.max_held_bytes, "under_way": self.started is not None}
