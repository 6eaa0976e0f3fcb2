"""What the coordinator has queued for each client, in bytes, and the budget that bounds it.

libzmq bounds a peer's queue in messages (SNDHWM), not bytes, and says nothing of what it still
holds. So each client's queued bytes are summed as they are sent, and some messages are sent
zero-copy with a pyzmq MessageTracker, done once libzmq has released the frame; a client's queue
is first in, first out, so everything sent before it is released too. A tracked send costs several
times a copied one (docs/performance.md, "Figures behind design choices"), so not every per-token
Delta is tracked: a checkpoint is put every CHECKPOINT_BYTES (a message that large
is one itself), and on the last message before a client goes idle (no request in flight), so an
idle client's account is known to be empty and is forgotten. What is queued is then known from
above to within CHECKPOINT_BYTES. Each message counts MESSAGE_OVERHEAD bytes beyond its body
(libzmq's msg_t and allocation), a tracked one TRACKED_OVERHEAD more (pyzmq's frame, tracker
and event), so many small messages are bounded as surely as a few large ones.

Lifecycle: the coordinator owns one `Outbox(budget)` for its client ROUTER. `send()` queues a
message unless the client's queued bytes would pass its budget (a notice of the abort that
follows may use NOTICE_SHARE more): `OVER_BUDGET` then, and the coordinator ends that client's
requests with the typed error `client_too_slow`; `FAILED` when libzmq refused it (client gone, or
SNDHWM messages queued). Accounts are forgotten by `prune()` (housekeeping) once known empty, or
after FORGET_IDLE_S without a send while the client has no request in flight (what is forgotten
then is under CHECKPOINT_BYTES).
"""
from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field

import zmq

CHECKPOINT_BYTES = 64 * 1024  # a tracked message at least this often, per client
MESSAGE_OVERHEAD = 128  # bytes counted per queued message beyond its body
TRACKED_OVERHEAD = 1024  # and per tracked message
NOTICE_SHARE = 8  # abort notices may pass the budget by budget / NOTICE_SHARE
FORGET_IDLE_S = 10.0


class Sent(enum.Enum):
    OK = 0
    OVER_BUDGET = 1
    FAILED = 2


@dataclass
class Account:
    sent: int = 0  # bytes ever queued (bodies and overheads)
    released: int = 0  # of those, known released by libzmq (at the newest done checkpoint)
    marked: int = 0  # `sent` at the newest checkpoint
    checkpoints: collections.deque = field(default_factory=collections.deque)  # (tracker, sent after it)
    last_send: float = 0.0

    def queued(self) -> int:
        """Bytes libzmq may still hold for this client (an upper bound)."""
        while self.checkpoints and self.checkpoints[0][0].done:
            self.released = self.checkpoints.popleft()[1]
        return self.sent - self.released


class Outbox:
    def __init__(self, budget: int):
        self.budget = budget
        self.accounts: dict[bytes, Account] = {}

    def queued(self, ident: bytes) -> int:
        a = self.accounts.get(ident)
        return a.queued() if a is not None else 0

    def send(self, io, ident: bytes, body: bytes, idle: bool, notice: bool = False) -> Sent:
        """Queue body for client ident on `io` (wire/loop_io.SocketIO). idle: the client has no
        request in flight after this message; notice: an abort notice (may use the overdraft)."""
        a = self.accounts.get(ident)
        if a is None:
            a = self.accounts[ident] = Account()
        cost = len(body) + MESSAGE_OVERHEAD
        track = idle or a.sent + cost - a.marked >= CHECKPOINT_BYTES
        cost += TRACKED_OVERHEAD if track else 0
        limit = self.budget + (self.budget // NOTICE_SHARE if notice else 0)
        if a.sent + cost - a.released > limit and a.queued() + cost > limit:
            return Sent.OVER_BUDGET
        frame = zmq.Frame(body, track=True, copy=False) if track else body
        if not io.send([ident, frame]):
            return Sent.FAILED
        a.sent += cost
        a.last_send = time.monotonic()
        if track:
            a.checkpoints.append((frame.tracker, a.sent))
            a.marked = a.sent
        return Sent.OK

    def prune(self, busy) -> None:
        """Forget accounts known empty, and those of idle clients silent for FORGET_IDLE_S.
        busy(ident): the client has requests in flight."""
        now = time.monotonic()
        for ident in [i for i, a in self.accounts.items()
                      if not busy(i) and (a.queued() == 0 or (not a.checkpoints and now - a.last_send > FORGET_IDLE_S))]:
            del self.accounts[ident]
