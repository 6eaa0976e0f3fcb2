"""Bounds: every socket has a maximum message size and every queue a bound, and a full queue is a
typed error or a counted drop, never memory growth.

Lifecycle: the socket-option checks build each socket in-process (coordinator ROUTERs, client
DEALERs, the worker link's DEALER, the kv ROUTER and the kv sender's DEALER) and close them.
The kv ROUTER admits any header up to MAX_CONTROL_MESSAGE whatever its pool's size (one layer
bounds it only when larger). The live tests start a coordinator and one prefill + one decode
worker (real processes on loopback, tiny model): an oversized frame sent to each endpoint is
dropped with its connection (never decoded, so never counted) and the next normal request
succeeds; a request too large to encode is refused by the client without touching its
connection; one whose Prefill could outgrow the worker link is refused by the coordinator
(limit_exceeded) while a job held on the prefill worker is served; with
`--max-active-requests 4 --max-client-requests 3` the fourth request of one client and the fifth
overall are refused as `overloaded` at once, and accepted again once load falls. The worker
link's inbox test runs a fake coordinator in-process: past the inbox bound messages are
dropped and counted, and the link keeps heartbeating (its I/O thread never blocks).
"""
import asyncio
import json
import time

import msgspec
import pytest
import torch
import zmq

from pdserve.coordinator.server import Coordinator, CoordinatorConfig
from pdserve.kvtransfer.transfer import KVReceiver, KVSender
from pdserve.wire.link import WorkerLink
from pdserve.wire.protocol import PROTOCOL_VERSION, Abort, Heartbeat, Hello, Role, Welcome, WorkerToCoordinator
from pdserve_client.library import AsyncClient, Client, InvalidRequest, Overloaded
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import MAX_CONTROL_MESSAGE, CoordinatorToClient, Delta, GenerateRequest, decoder, encode
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

OVERSIZED = MAX_CONTROL_MESSAGE + 1


# ------------------------------------------------------------------ socket options, in-process

def test_every_socket_has_a_message_size_limit():
    coord = Coordinator(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"), tokenizer=object())
    try:
        for sock in (coord.client_sock, coord.worker_sock):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_CONTROL_MESSAGE
            assert 0 < sock.getsockopt(zmq.SNDHWM) <= coord.cfg.send_hwm  # 0 would be unbounded
    finally:
        coord.release_sockets()

    with Client(f"tcp://127.0.0.1:{free_port()}") as c:
        assert c.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_CONTROL_MESSAGE

    async def async_client():
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}") as c:
            return c.sock.getsockopt(zmq.MAXMSGSIZE)

    assert asyncio.run(async_client()) == MAX_CONTROL_MESSAGE

    ctx = zmq.Context()
    try:
        hello = Hello(PROTOCOL_VERSION, "w", int(Role.DECODE), 1, "h", "b", "m", 16, 1, 16)
        link = WorkerLink(ctx, f"tcp://127.0.0.1:{free_port()}", hello, heartbeat=lambda: None)
        dealer = link._dealer()
        assert dealer.getsockopt(zmq.MAXMSGSIZE) == MAX_CONTROL_MESSAGE
        assert link.inbox.maxsize == WorkerLink.INBOX_SIZE > 0
        dealer.close(linger=0)
        link._pull.close(linger=0)

        pool = torch.zeros(2, 2, 64, 16, 2, 16)  # (layers, 2, blocks, block size, kv heads, head dim): 256 KiB a layer
        rx = KVReceiver(ctx, pool, f"tcp://127.0.0.1:{free_port()}")
        assert rx.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_CONTROL_MESSAGE  # any header the coordinator lets through
        assert rx.sock.getsockopt(zmq.RCVHWM) > 0
        rx.close()
        big = torch.zeros(1, 2, 2048, 16, 2, 128, dtype=torch.bfloat16)  # 32 MiB a layer: a tcp layer frame must pass
        rx = KVReceiver(ctx, big, f"tcp://127.0.0.1:{free_port()}")
        limit = rx.sock.getsockopt(zmq.MAXMSGSIZE)
        rx.close()
        assert limit == 32 * 2**20
        tx = KVSender(ctx, "p")
        assert tx._socket(f"tcp://127.0.0.1:{free_port()}").getsockopt(zmq.MAXMSGSIZE) == MAX_CONTROL_MESSAGE
        tx.close()
    finally:
        ctx.term()


def test_worker_registrations_are_bounded_and_checked():
    """A Hello past max_workers, or one with impossible fields, is refused before any state
    changes; a heartbeat with a non-finite number is ignored and counted; stats stay valid JSON."""
    async def go():
        cfg = CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", max_workers=2)
        coord = Coordinator(cfg, tokenizer=object())
        try:
            def hello(wid, role=int(Role.DECODE), block_size=16, profile=()):
                return Hello(PROTOCOL_VERSION, wid, role, 1, "h", "b", "m", 256, 64, block_size, profile=list(profile))

            for i, h in enumerate([hello("bad-role", role=7), hello("bad-block", block_size=0), hello("", ),
                                   hello("bad-profile", profile=[(1, 1, 1, float("nan"))])]):
                coord.on_hello(b"bad%d" % i, h)
            assert coord.workers == {} and coord.counts["rejected_workers"] == 4
            for i in range(3):
                coord.on_hello(b"id%d" % i, hello(f"w{i}"))
            assert set(coord.workers) == {"w0", "w1"} and coord.counts["rejected_workers"] == 5
            coord.on_worker(b"id0", Heartbeat("w0", 10, 0, 0, 0, kv_seconds_sent=float("nan")))
            assert coord.counts["invalid_worker_messages"] == 1 and coord.workers["w0"].beat is None
            msgspec.json.decode(json.dumps(coord.stats()).encode())  # strict JSON: no NaN got in
        finally:
            coord.release_sockets()

    asyncio.run(go())


# ------------------------------------------------------------------ live: oversized frames, request bounds

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=256)
    # a 1 s batching window holds prompts on the prefill worker, so that requests stay in flight
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "8"],
                             prefill_args=["--batch-window-ms", "1000"],
                             coordinator_args=["--max-active-requests", "4", "--max-client-requests", "3"])
    yield launcher
    launcher.stop()


def alive(launcher) -> bool:
    return all(p.poll() is None for _, p in launcher.procs)


def send_oversized(addr: str, size: int) -> None:
    """One frame over the endpoint's limit: zmq closes that connection (nothing reaches the process)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 5000)  # let it leave before the socket closes
    s.connect(addr)
    s.send(b"\x92" + b"x" * (size - 1), copy=False)
    s.close()
    ctx.term()  # returns once the frame has gone (or the linger passed)


def test_oversized_frames_are_dropped_at_every_endpoint(cluster):
    with Client(cluster.plan.client_addr, timeout=30) as c:
        before = c.stats()
        decode = next(w for w in before["workers"] if w["role"] == "decode")
        send_oversized(cluster.plan.client_addr, OVERSIZED)
        send_oversized(cluster.plan.worker_addr, OVERSIZED)
        send_oversized(decode["kv_endpoint"], OVERSIZED)  # over the kv socket's limit too (max of one layer, MAX_CONTROL_MESSAGE)
        assert alive(cluster)
        r = c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=3, ignore_eos=True)
        assert r.completion_tokens == 3
        after = wait_all_blocks_free(c)
        # dropped by zmq, not decoded: no bad message was counted anywhere
        for name in ("bad_client_messages", "bad_worker_messages"):
            assert after["requests"].get(name, 0) == before["requests"].get(name, 0), name
        assert next(w for w in after["workers"] if w["id"] == decode["id"])["bad_messages"] == decode["bad_messages"]
        assert {w["id"] for w in after["workers"]} == {w["id"] for w in before["workers"]}
    assert alive(cluster)


def test_request_too_large_to_send_is_refused_by_the_client(cluster):
    with Client(cluster.plan.client_addr, timeout=30) as c:
        with pytest.raises(InvalidRequest, match="limit"):
            c.generate(token_ids=list(range(100_000, 100_000 + 4 * 2**20)))  # 5 bytes a token id in msgpack: 20 MiB
        # the connection is untouched: the same client is served next
        assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=2, ignore_eos=True).completion_tokens == 2


def test_a_request_whose_prefill_would_outgrow_the_worker_link_is_refused(cluster):
    """A direct client's request under the client socket's limit whose Prefill (its params and
    token ids, with the worker's names) could pass MAX_CONTROL_MESSAGE: refused as limit_exceeded
    before any worker sees it, so the prefill worker's link (and every job on it) stays up."""
    async def go():
        async with AsyncClient(cluster.plan.client_addr, timeout=60) as c:
            before = {w["id"]: w for w in (await c.stats())["workers"]}
            held = asyncio.create_task(c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=5, ignore_eos=True))
            deadline = time.monotonic() + 10
            while (await c.stats())["active_requests"] != 1:  # on the prefill worker, in its 1 s batching window
                assert time.monotonic() < deadline, "the held request never started"
                await asyncio.sleep(0.02)
            spec = "x" * (MAX_CONTROL_MESSAGE - 2**15)
            t0 = time.monotonic()
            with pytest.raises(InvalidRequest) as refused:
                await c.generate(token_ids=[5, 6, 7], max_tokens=2, structured=StructuredOutput("regex", spec))
            assert refused.value.code == "limit_exceeded" and time.monotonic() - t0 < 10
            assert (await held).completion_tokens == 5  # the prefill worker's other job is served
            after = await c.stats()
            assert after["requests"].get("workers_lost", 0) == 0 and {w["id"] for w in after["workers"]} == set(before)
            assert all(w["bad_messages"] == before[w["id"]]["bad_messages"] for w in after["workers"])

    asyncio.run(go())
    with Client(cluster.plan.client_addr) as c:
        wait_all_blocks_free(c)
    assert alive(cluster)


def test_a_client_that_goes_away_has_its_requests_aborted(cluster):
    """No AbortRequest: the client's connection just closes mid-stream. The coordinator's next send
    to it fails, and it aborts the request, freeing its blocks, rather than streaming into the void."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(cluster.plan.client_addr)
    s.send(encode(GenerateRequest("gone", SamplingParams(max_tokens=240, temperature=0, ignore_eos=True), token_ids=[5, 6, 7])))
    assert s.poll(30_000)
    assert isinstance(decoder(CoordinatorToClient).decode(s.recv()), Delta)
    s.close()
    ctx.term()
    with Client(cluster.plan.client_addr) as c:
        before = c.stats()["requests"].get("client_gone_aborts", 0)
        poll(lambda: c.stats()["active_requests"] == 0, timeout=10)
        stats = wait_all_blocks_free(c)
        assert stats["requests"]["client_gone_aborts"] >= max(before, 1)
        assert stats["requests"]["client_send_failures"] >= 1


def test_active_request_bounds_refuse_with_overloaded(cluster):
    async def go():
        async with AsyncClient(cluster.plan.client_addr, timeout=60) as a, AsyncClient(cluster.plan.client_addr, timeout=60) as b:
            async def active(n):
                deadline = time.monotonic() + 10
                while (await a.stats())["active_requests"] != n:
                    assert time.monotonic() < deadline, f"never {n} active"
                    await asyncio.sleep(0.02)

            def long(c):
                return asyncio.create_task(c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=30, ignore_eos=True))

            held = [long(a) for _ in range(3)]
            await active(3)
            with pytest.raises(Overloaded, match="this client has 3 requests in flight"):
                await a.generate(token_ids=[5, 6], max_tokens=2)
            held.append(long(b))  # another client still has room: 4 in flight
            await active(4)
            with pytest.raises(Overloaded, match="the coordinator has 4 requests in flight"):
                await b.generate(token_ids=[5, 6], max_tokens=2)
            results = await asyncio.gather(*held)
            assert [r.completion_tokens for r in results] == [30] * 4
            # load fell: the same clients are served again
            assert (await a.generate(token_ids=[5, 6], temperature=0, max_tokens=2, ignore_eos=True)).completion_tokens == 2

    asyncio.run(go())
    with Client(cluster.plan.client_addr) as c:
        stats = wait_all_blocks_free(c)
        assert stats["requests"]["error:overloaded"] >= 2 and stats["active_requests"] == 0
    assert alive(cluster)


# ------------------------------------------------------------------ the worker link's inbox

class SmallLink(WorkerLink):
    INBOX_SIZE = 4


def test_link_inbox_is_bounded_and_drops_are_counted():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hello = Hello(PROTOCOL_VERSION, "w", int(Role.DECODE), 1, "h", "b", "m", 16, 1, 16)
    link = SmallLink(ctx, f"tcp://127.0.0.1:{port}", hello,
                     heartbeat=lambda: Heartbeat("w", 1, 0, 0, 0, inbox_dropped=link.dropped), interval=0.05)
    dec = decoder(WorkerToCoordinator)
    link.start()
    try:
        assert router.poll(5000)
        ident, body = router.recv_multipart()
        assert isinstance(dec.decode(body), Hello)
        router.send_multipart([ident, encode(Welcome(PROTOCOL_VERSION))])
        assert link.registered.wait(5)
        for i in range(10):  # nobody drains the inbox: 4 fit, 6 are dropped
            router.send_multipart([ident, encode(Abort(f"r{i}"))])
        poll(lambda: link.dropped == 6, timeout=5)
        assert link.inbox.qsize() == 4
        # the I/O thread did not block: it still heartbeats, reporting the drops
        deadline = time.monotonic() + 5
        while True:
            assert router.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no heartbeat after the drops"
            msg = dec.decode(router.recv_multipart()[1])
            if isinstance(msg, Heartbeat) and msg.inbox_dropped == 6:
                break
        assert [m.request_id for m in link.drain(0)] == ["r0", "r1", "r2", "r3"]  # the oldest were kept, in order
    finally:
        link.stop()
        router.close(linger=0)
        ctx.destroy(linger=0)
