"""The per-client send budget (coordinator/outbox.py) on real ZeroMQ sockets: a DEALER that does
not read is refused past the budget while what libzmq holds for it stays under the budget; once it
reads, its account drains and sends go through again; an idle, drained account is forgotten."""
import time

import zmq

from pdserve.coordinator.outbox import CHECKPOINT_BYTES, MESSAGE_OVERHEAD, TRACKED_OVERHEAD, Outbox, Sent
from pdserve.wire.loop_io import SocketIO
from tests.gateway.helpers import poll

BUDGET = 2 * 2**20


def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 100_000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)  # the reader's side holds little: what it does not read stays with the sender
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    return ctx, router, dealer, ident


def test_a_client_that_does_not_read_is_held_to_its_budget_and_served_again_once_it_reads():
    ctx, router, dealer, ident = pair()
    try:
        io, box = SocketIO(router), Outbox(BUDGET)
        body = b"x" * 10_000
        sent = 0
        while (outcome := box.send(io, ident, body, idle=False)) is Sent.OK:
            sent += 1
            assert sent < 10_000, "never refused"
        assert outcome is Sent.OVER_BUDGET
        assert box.queued(ident) <= BUDGET  # what libzmq may still hold for it
        assert sent * len(body) > BUDGET // 2  # and the budget was used, not refused early
        # a notice may use the overdraft once; a second budget's worth may not
        assert box.send(io, ident, b"notice", idle=False, notice=True) is Sent.OK
        assert box.send(io, ident, body * 30, idle=False, notice=True) is Sent.OVER_BUDGET
        got = 0
        while got < sent + 1:  # the client reads everything: the tracked checkpoints complete
            if dealer.poll(5000):
                dealer.recv()
                got += 1
            else:
                raise AssertionError(f"only {got} of {sent + 1} messages arrived")
        assert box.send(io, ident, b"last", idle=True) is Sent.OK  # tracked: the account can be known empty
        dealer.recv()
        poll(lambda: box.queued(ident) == 0, timeout=5)
        box.prune(lambda i: True)  # a client with requests in flight keeps its account
        assert ident in box.accounts
        box.prune(lambda i: False)
        assert ident not in box.accounts
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_small_messages_are_tracked_once_a_checkpoint_and_counted_with_their_overhead():
    ctx, router, dealer, ident = pair()
    try:
        io, box = SocketIO(router), Outbox(BUDGET)
        n = 2000
        for _ in range(n):
            assert box.send(io, ident, b"d" * 100, idle=False) is Sent.OK
        a = box.accounts[ident]
        assert a.sent >= n * (100 + MESSAGE_OVERHEAD)
        tracked = (a.sent - n * (100 + MESSAGE_OVERHEAD)) // TRACKED_OVERHEAD
        assert tracked == n * (100 + MESSAGE_OVERHEAD) // CHECKPOINT_BYTES  # not one per message
        t0 = time.monotonic()
        while box.queued(ident) > a.sent - a.marked:  # everything up to the newest checkpoint drains as the client reads
            while dealer.poll(0):
                dealer.recv()
            assert time.monotonic() - t0 < 10
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
