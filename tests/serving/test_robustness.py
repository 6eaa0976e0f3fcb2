"""Cancellation and bad input against a live cluster (real processes on loopback): a cancelled
stream frees its blocks on both sides within 1 s; garbage, unknown messages, oversized frames
and wrong protocol versions are answered with a typed error or dropped and counted; no process
dies; invalid requests get a clear error at the client."""
import time

import msgspec
import pytest
import zmq

from pdserve.wire.protocol import PROTOCOL_VERSION, Heartbeat, Hello, Reject, Role, TokenBatch, TokenOut
from pdserve_client.library import Client, InvalidRequest, PromptTooLong
from pdserve_client.protocol import CoordinatorToClient, ErrorReply, decoder, encode
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=256)
    # heartbeats every 0.1 s: the 1 s cancel test reads the blocks from heartbeats sent after the abort
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=1, decode=1, engine_args=["--kv-cache-mb", "8", "--heartbeat-s", "0.1"])
    yield launcher
    launcher.stop()


def alive(launcher):
    return all(p.poll() is None for _, p in launcher.procs)


def test_cancel_mid_stream_frees_blocks_within_1s(cluster):
    with Client(cluster.plan.client_addr) as c:
        stream = c.stream(token_ids=list(range(100, 180)), temperature=0, max_tokens=200, ignore_eos=True)
        got = 0
        for delta in stream:
            got += len(delta.token_ids)
            if got >= 3:
                break
        stream.close()  # abandons the request: the client sends AbortRequest
        t0 = time.monotonic()
        stats = wait_all_blocks_free(c, timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        assert stats["requests"].get("finished:abort", 0) >= 1
        assert c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=4, ignore_eos=True).completion_tokens == 4


def raw_dealer(addr):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def test_client_port_bad_input(cluster):
    s = raw_dealer(cluster.plan.client_addr)
    dec = decoder(CoordinatorToClient)
    bad = [b"\xc1\xff garbage", msgspec.msgpack.encode({"hello": 1}), encode(TokenBatch([TokenOut("x", 1)])), b""]
    for body in bad:
        s.send(body)
        assert s.poll(5000), "no answer to a bad message"
        reply = dec.decode(s.recv())
        assert isinstance(reply, ErrorReply) and reply.code == "bad_message"
    s.send_multipart([b"two", b"frames"])  # wrong framing: dropped and counted
    big = raw_dealer(cluster.plan.client_addr)
    big.send(b"x" * (17 * 2**20))  # over the 16 MiB limit: zmq drops the connection
    time.sleep(0.2)
    big.close()
    s.close()
    with Client(cluster.plan.client_addr) as c:
        stats = c.stats()
        assert stats["requests"]["bad_client_messages"] >= len(bad) + 1
        assert c.generate(token_ids=[1, 2, 3], temperature=0, max_tokens=3, ignore_eos=True).completion_tokens == 3
    assert alive(cluster)


def test_worker_port_bad_input_and_wrong_version(cluster):
    s = raw_dealer(cluster.plan.worker_addr)
    for body in (b"\x00\x01junk", msgspec.msgpack.encode([1, 2, 3])):
        s.send(body)
    # A heartbeat from a worker that never said Hello is told to register.
    s.send(encode(Heartbeat("ghost", 0, 0, 0, 0)))
    assert s.poll(5000)
    reply = decoder(Reject).decode(s.recv())
    assert reply.reason == "unregistered"
    s.send(encode(Hello(PROTOCOL_VERSION + 1, "future", int(Role.DECODE), 1, "h", "b", "m", 10, 10, 16)))
    assert s.poll(5000)
    assert "protocol version" in decoder(Reject).decode(s.recv()).reason
    s.close()
    with Client(cluster.plan.client_addr) as c:
        stats = c.stats()
        assert stats["requests"]["bad_worker_messages"] >= 2
        assert stats["requests"]["rejected_workers"] >= 1
        assert "future" not in {w["id"] for w in stats["workers"]}
    assert alive(cluster)


def test_invalid_requests_get_typed_errors(cluster):
    with Client(cluster.plan.client_addr) as c:
        with pytest.raises(InvalidRequest, match="temperature"):
            c.generate("hello", temperature=-1)
        with pytest.raises(InvalidRequest, match="top_p"):
            c.generate("hello", top_p=0)
        with pytest.raises(InvalidRequest, match="max_tokens"):
            c.generate("hello", max_tokens=0)
        with pytest.raises(PromptTooLong, match="context is 256"):
            c.generate(token_ids=list(range(10, 300)))
        with pytest.raises(InvalidRequest, match="exactly one"):
            c.generate("hello", token_ids=[1, 2])
        with pytest.raises(InvalidRequest):
            c.generate("hello", no_such_option=1)
        r = c.generate("Hello there", temperature=0, max_tokens=5, ignore_eos=True)
        from pdserve.common.tokenizer import load_tokenizer

        assert r.completion_tokens == 5 and r.prompt_tokens == len(load_tokenizer(None).encode("Hello there"))
        wait_all_blocks_free(c)
    assert alive(cluster)
