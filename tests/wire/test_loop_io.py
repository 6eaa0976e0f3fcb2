"""SocketIO (wire/loop_io.py): ZeroMQ sockets read from an asyncio loop by draining on
each wake-up. ZeroMQ's descriptor is edge-triggered and sends on the same socket consume its
edge, so these tests interleave sends and receives on one ROUTER from two tasks and require
that nothing is ever left unread (each bounded by a timeout: a missed edge shows as a hang;
the window for one is narrow, so a pass exercises the re-checks rather than proving them).

Lifecycle: each test builds a ROUTER wrapped in SocketIO and plain DEALER peers on loopback
inside one asyncio.run, and closes them all at the end.
"""
import asyncio

import zmq

from pdserve.wire.loop_io import SocketIO
from tests.helpers import free_port


def with_router(body):
    async def go():
        ctx = zmq.Context()
        addr = f"tcp://127.0.0.1:{free_port()}"
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(addr)
        io = SocketIO(router, drain_batch=16)
        io.start()
        try:
            await asyncio.wait_for(body(ctx, addr, io), 20)
        finally:
            io.stop()
            ctx.destroy(linger=0)

    asyncio.run(go())


def dealer(ctx, addr):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def test_ping_pong_never_stalls_while_another_task_sends_on_the_same_socket():
    """One message in flight at a time, so each arrival is a lone edge; a second task sends on
    the ROUTER at every loop turn, and any of those sends may consume that edge."""
    rounds = 300

    async def body(ctx, addr, io):
        peer = dealer(ctx, addr)
        idents = []

        async def echo():
            async for ident, payload in io.messages():
                if not idents:
                    idents.append(ident)
                assert io.send([ident, payload])

        async def chatter():
            while True:
                for ident in idents:
                    io.send([ident, b"tick"])
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(echo()), asyncio.create_task(chatter())]
        try:
            for i in range(rounds):
                peer.send(b"%d" % i)
                while True:  # the echo comes back between ticks
                    while not peer.poll(0):
                        await asyncio.sleep(0)
                    if peer.recv() == b"%d" % i:
                        break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    with_router(body)


def test_send_to_a_gone_peer_reports_false_and_a_long_burst_yields_to_the_loop():
    async def body(ctx, addr, io):
        io.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        assert io.send([b"nobody", b"x"]) is False  # EHOSTUNREACH: reported, not raised
        io.sock.bind("inproc://burst")  # inproc: all 200 are queued at the router before the drain starts
        p = dealer(ctx, "inproc://burst")
        for _ in range(200):
            p.send(b"m")
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        at_tick = []
        async for _ in io.messages():
            at_tick.append(ticks)
            if len(at_tick) == 200:
                break
        t.cancel()
        runs = [at_tick.count(v) for v in set(at_tick)]
        assert max(runs) <= 16 and len(runs) >= 200 // 16  # drain_batch 16, then the loop's other tasks ran

    with_router(body)
