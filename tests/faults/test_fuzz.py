"""Wire fuzz against a live service: coordinator, HTTP gateway, one prefill and one decode worker
(real processes on loopback, a tiny random model with a 256-token context).

Lifecycle: one cluster for the module. Each ZeroMQ test throws 10,000 random and mutated
messages (tests/faults/fuzzing.py: mutations of valid encoded protocol messages, random bytes,
wrong-shape msgpack, multi-frame messages) at one endpoint: the coordinator's client port, its
worker port, a decode worker's kv endpoint. The HTTP test posts mutated JSON bodies to both
completion endpoints. Each input is classified here with the same typed decoder (or, for the kv
socket, the same KVReceiver) the endpoint uses, so each test checks that the endpoint counted
exactly the bad ones; then that no process died, the requests the fuzz made valid have ended,
every KV block is free and a normal request succeeds. A last test plays a rogue decode worker
whose kv endpoint is unusable: the prefill worker must survive handing off to it. Seeds are
fixed: a failure replays.
"""
import random
import threading
import time

import httpx
import msgspec
import pytest
import torch
import zmq

from pdserve.kvtransfer.transfer import KVReceiver
from pdserve.wire.limits import SCAN_FIRST_BYTES, RequestLimits
from pdserve.wire.protocol import (
    PROTOCOL_VERSION,
    Admit,
    AdmitRefused,
    Granted,
    Heartbeat,
    Hello,
    KVFailed,
    KVReady,
    PrefillDone,
    Role,
    TokenBatch,
    TokenOut,
    Welcome,
    WorkerError,
    WorkerToCoordinator,
)
from pdserve_client.library import Client, WorkerLost
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import (
    AbortRequest,
    ChatMessage,
    ClientToCoordinator,
    CoordinatorToClient,
    Delta,
    ErrorReply,
    GenerateRequest,
    StatsRequest,
    StatusRequest,
    decoder,
    encode,
)
from tests.faults.fuzzing import fuzz_messages, mutate_json
from tests.gateway.helpers import poll, scrape, start_gateway_cluster, value
from tests.helpers import save_tiny_served_model, wait_all_blocks_free

N = 10_000  # messages per ZeroMQ endpoint
N_HTTP = 1500
CONTEXT = 256
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16  # the tiny model below (hidden 64, 4 heads) and the default block size
REAL = {"t-prefill-0", "t-decode-0"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=CONTEXT)
    return d


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    # --heartbeat-s 0.1 (as tests/serving/test_robustness.py): each check_healthy waits for two fresh
    # heartbeats twice (wait_all_blocks_free); the fuzz is about the wire, not the heartbeat's period
    launcher = start_gateway_cluster(model_dir, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "8", "--heartbeat-s", "0.1"])
    yield launcher
    launcher.stop()


def stats(cluster) -> dict:
    with Client(cluster.plan.client_addr, timeout=10) as c:
        return c.stats()


def check_healthy(cluster) -> dict:
    """Every process alive, no handler raised, only the real workers registered, nothing in
    flight, every block free, and a normal request served end to end."""
    assert all(p.poll() is None for _, p in cluster.procs), [(n, p.returncode) for n, p in cluster.procs]
    assert counter(cluster, "internal_errors") == 0, "a coordinator handler raised (see the coordinator's log)"
    poll(lambda: {w["id"] for w in stats(cluster)["workers"]} == REAL, timeout=15)
    poll(lambda: stats(cluster)["active_requests"] == 0, timeout=30)
    with Client(cluster.plan.client_addr, timeout=30) as c:
        wait_all_blocks_free(c, timeout=10)
        r = c.generate(token_ids=[5, 6, 7, 8], temperature=0, max_tokens=4, ignore_eos=True)
        assert r.completion_tokens == 4 and r.finish_reason == "length"
        return wait_all_blocks_free(c, timeout=10)


def dealer(addr: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def send_all(socks: list[zmq.Socket], messages, on_reply=None) -> int:
    """Send every message (round robin over socks), reading replies as they come; returns the count."""
    n = 0
    for frames in messages:
        socks[n % len(socks)].send_multipart(frames)
        n += 1
        if on_reply is not None and n % 64 == 0:
            for s in socks:
                while s.poll(0):
                    on_reply(s.recv_multipart())
    return n


def counter(cluster, name: str) -> int:
    return stats(cluster)["requests"].get(name, 0)


# ------------------------------------------------------------------ coordinator, client port

def client_templates() -> list[list[bytes]]:
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    msgs = [
        GenerateRequest("fz-1", greedy, prompt="Hello there"),
        GenerateRequest("fz-2", SamplingParams(max_tokens=1, ignore_eos=True, stop=["x"], seed=3, logprobs=2, top_k=5), token_ids=[5, 6, 7]),
        GenerateRequest("fz-3", greedy, messages=[ChatMessage("user", "hi")], priority=1, ttft_ms=100.0),
        AbortRequest("fz-1"), StatsRequest(), StatusRequest("fz-2"),
        Delta("fz-4", [1], "a"), ErrorReply("fz-5", "x", "y"), Heartbeat("fz-w", 1, 0, 0, 0),  # valid, but not for this port
    ]
    return [[encode(m)] for m in msgs]


def test_client_port_fuzz(cluster):
    dec = decoder(ClientToCoordinator)
    replies = decoder(CoordinatorToClient)
    rng = random.Random(1)
    messages = list(fuzz_messages(rng, client_templates(), N))
    # a large frame whose prompt or stop list is over the limits by its length is refused before it is
    # decoded (wire/limits.py): answered limit_exceeded, whether or not the rest of it would decode
    limits = RequestLimits()
    refused = [len(f) == 1 and len(f[0]) > SCAN_FIRST_BYTES and limits.oversized_frame(f[0]) is not None for f in messages]
    bad = [not r and (len(f) != 1 or _undecodable(dec, f[0])) for f, r in zip(messages, refused)]
    answered = [0]
    limited = [0]

    def on_reply(frames):
        assert len(frames) == 1
        msg = replies.decode(frames[0])  # the coordinator only ever sends what a client can decode
        answered[0] += isinstance(msg, ErrorReply) and msg.code == "bad_message"
        limited[0] += isinstance(msg, ErrorReply) and msg.code == "limit_exceeded"

    before = counter(cluster, "bad_client_messages")
    sock = dealer(cluster.plan.client_addr)
    t0 = time.monotonic()
    assert send_all([sock], messages, on_reply) == N
    # every undecodable single frame is answered with a typed ErrorReply; multi-frame ones are dropped
    want_answers = sum(b and len(f) == 1 for b, f in zip(bad, messages))
    deadline = time.monotonic() + 30
    while (answered[0] < want_answers or limited[0] < sum(refused)) and time.monotonic() < deadline:
        if sock.poll(100):
            on_reply(sock.recv_multipart())
    assert answered[0] == want_answers
    assert limited[0] >= sum(refused)  # (a valid request the fuzz made may be refused by a limit too)
    poll(lambda: counter(cluster, "bad_client_messages") >= before + sum(bad), timeout=30)
    assert counter(cluster, "bad_client_messages") == before + sum(bad), "each bad message is counted once"
    print(f"client port: {N} messages ({sum(bad)} bad) in {time.monotonic() - t0:.1f}s")
    sock.close()  # the requests the fuzz made valid are aborted once the coordinator finds this client gone
    check_healthy(cluster)


def _undecodable(dec, body: bytes) -> bool:
    try:
        dec.decode(body)
        return False
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True


# ------------------------------------------------------------------ coordinator, worker port

def worker_templates() -> list[list[bytes]]:
    hello = Hello(PROTOCOL_VERSION, "fz-w", int(Role.DECODE), 1, "fz-host", "fz-boot", "m", CONTEXT, 100, BLOCK,
                  "tcp://127.0.0.1:1", [(1, 64, 64, 0.01)])
    msgs = [
        hello, Hello(PROTOCOL_VERSION, "fz-p", int(Role.PREFILL), 2, "fz-host", "fz-boot", "m", CONTEXT, 100, BLOCK),
        Heartbeat("fz-w", 100, 0, 0, 0, steps=[(1, 1, 1, 0.001)]), Granted("fz-r", [1, 2]), AdmitRefused("fz-r", "full"),
        TokenBatch([TokenOut("fz-r", 5), TokenOut("fz-r", -1, finish_reason=0)]), PrefillDone("fz-r", 10, 100, 0.1, 0.1),
        WorkerError("fz-r", "x", "y"),
        Admit("fz-r", 5), Welcome(PROTOCOL_VERSION),  # valid, but not for this port
    ]
    return [[encode(m)] for m in msgs]


def test_worker_port_fuzz(cluster):
    dec = decoder(WorkerToCoordinator)
    rng = random.Random(2)
    messages = list(fuzz_messages(rng, worker_templates(), N))
    bad = sum(len(f) != 1 or _undecodable(dec, f[0]) for f in messages)
    before = counter(cluster, "bad_worker_messages")
    socks = [dealer(cluster.plan.worker_addr) for _ in range(8)]  # 8 identities: several may register as ghosts
    t0 = time.monotonic()
    assert send_all(socks, messages, on_reply=lambda frames: None) == N
    poll(lambda: counter(cluster, "bad_worker_messages") >= before + bad, timeout=30)
    assert counter(cluster, "bad_worker_messages") == before + bad, "each bad message is counted once"
    print(f"worker port: {N} messages ({bad} bad) in {time.monotonic() - t0:.1f}s")
    for s in socks:
        s.close()
    check_healthy(cluster)  # ghost workers a mutated Hello registered are dropped once silent


# ------------------------------------------------------------------ decode worker, kv socket

def kv_templates() -> list[list[bytes]]:
    layer = torch.zeros(2, 2, BLOCK, KV_HEADS, HEAD_DIM).view(torch.uint8).numpy().tobytes()  # 2 blocks of one layer
    p = SamplingParams(max_tokens=2)
    return [
        [encode(KVReady("fz-k", [1, 2, 3], [4], p, [0], 4, "shm"))],
        [encode(KVReady("fz-k2", [1, 2, 3], [4], p, [0, 1], 20, "tcp")), *[layer] * LAYERS],
        [encode(KVFailed("fz-k", "gone"))],
        [encode(Admit("fz-k", 4))],  # valid, but not for this socket
    ]


def test_kv_endpoint_fuzz(cluster):
    decode = next(w for w in stats(cluster)["workers"] if w["id"] == "t-decode-0")
    assert decode["kv_endpoint"].startswith("tcp://127.0.0.1:")
    rng = random.Random(3)
    messages = list(fuzz_messages(rng, kv_templates(), N))
    bad = oracle_bad_count(messages, decode["total_blocks"])
    before = decode["bad_messages"]
    sock = dealer(decode["kv_endpoint"])
    t0 = time.monotonic()
    assert send_all([sock], messages, on_reply=lambda frames: None) == N

    def bad_now():
        return next(w for w in stats(cluster)["workers"] if w["id"] == decode["id"])["bad_messages"]

    poll(lambda: bad_now() >= before + bad, timeout=30)
    assert bad_now() == before + bad, "each bad message is counted once"
    print(f"kv endpoint: {N} messages ({bad} bad) in {time.monotonic() - t0:.1f}s")
    sock.close()
    check_healthy(cluster)


def oracle_bad_count(messages, num_blocks: int) -> int:
    """Feed the messages through an in-process KVReceiver over a pool of the same shape: the
    number it counts is the number the decode worker must count."""
    ctx = zmq.Context()
    pool = torch.zeros(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    rx = KVReceiver(ctx, pool, "inproc://kv-oracle")
    tx = ctx.socket(zmq.DEALER)
    tx.connect("inproc://kv-oracle")
    try:
        for frames in messages:
            tx.send_multipart(frames)
            rx.recv()
        return rx.bad_messages
    finally:
        tx.close(linger=0)
        rx.close()
        ctx.term()


# ------------------------------------------------------------------ gateway, HTTP bodies

def test_gateway_http_fuzz(cluster, model_dir):
    name = model_dir.name
    bases = {
        "/v1/completions": [
            {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
            {"model": name, "prompt": ["a b", "c"], "max_tokens": 1, "n": 2, "seed": 1, "stop": ["x"], "logprobs": 1},
            {"model": name, "prompt": [[5, 6, 7]], "max_tokens": 2, "stream": True, "top_k": 3, "ignore_eos": True},
        ],
        "/v1/chat/completions": [
            {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            {"model": name, "messages": [{"role": "system", "content": [{"type": "text", "text": "x"}]},
                                         {"role": "user", "content": "y"}], "max_completion_tokens": 1, "logprobs": True,
             "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}},
        ],
    }
    rng = random.Random(4)
    url = cluster.plan.http_url
    errors_before = value(scrape(url)[0], "pdserve_request_errors_total")
    statuses, error_events = {}, 0
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(N_HTTP):
            path = rng.choice(list(bases))
            body, headers = mutate_json(rng, rng.choice(bases[path]))
            r = http.post(path, content=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 404, 413, 429), (r.status_code, body[:300], r.text[:300])
            if r.status_code != 200:
                err = r.json()["error"]  # OpenAI's error shape, with a message and a type
                assert err["message"] and err["type"], r.text
            elif r.headers["content-type"].startswith("text/event-stream"):
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]", r.text[-300:]
                error_events += sum("error" in msgspec.json.decode(e) for e in events[:-1])
            else:
                assert r.json()["choices"], r.text
        # a body announced over the gateway's limit is refused (413) before any of it is read
        status, text = raw_post(url, "/v1/completions", 9 * 2**20, b"{\"prompt\": \"xxxx")
        assert status == 413 and "request_too_large" in text
        # so is one that would fan out into more coordinator requests than one request may make
        r = http.post("/v1/completions", json={"model": name, "prompt": ["a"] * 600, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and "choices" in r.json()["error"]["message"]
    print(f"gateway: {N_HTTP} bodies in {time.monotonic() - t0:.1f}s, statuses {statuses}")
    assert statuses.get(400, 0) > N_HTTP // 3 and statuses.get(200, 0) > 10  # the fuzz reached both sides
    failed = sum(n for s, n in statuses.items() if s != 200) + 2 + error_events  # + the 413 and 400 above
    poll(lambda: value(scrape(url)[0], "pdserve_request_errors_total") - errors_before == failed, timeout=10)
    check_healthy(cluster)


def raw_post(url: str, path: str, length: int, start: bytes) -> tuple[int, str]:
    """POST announcing `length` body bytes but sending only `start`: (status, response body)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode() + start)
        data = b""
        while True:
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                size = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), None)
                if size is not None and len(body) >= size:
                    break
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


# ------------------------------------------------------------------ a rogue decode worker

class RogueDecode(threading.Thread):
    """Registers as a decode worker with room for everything and an unusable kv endpoint, and
    grants every Admit blocks it does not have; heartbeats until stopped."""

    def __init__(self, addr: str, kv_endpoint: str, model: str):
        super().__init__(daemon=True)
        self.sock = dealer(addr)
        self.model = model  # the cluster's: a worker of another model is refused at registration
        self.kv_endpoint = kv_endpoint
        self.stop = threading.Event()
        self.admits = 0

    def run(self):
        dec = decoder(Welcome | Admit)
        hello = Hello(PROTOCOL_VERSION, "fz-rogue", int(Role.DECODE), 1, "fz-host", "fz-boot", self.model, CONTEXT, 10**6, BLOCK,
                      self.kv_endpoint)
        self.sock.send(encode(hello))
        next_beat = time.monotonic() + 0.3
        while not self.stop.is_set():
            if time.monotonic() > next_beat:
                self.sock.send(encode(Heartbeat("fz-rogue", 10**6, 0, 0, 0)))
                next_beat = time.monotonic() + 0.3
            if self.sock.poll(50):
                try:
                    msg = dec.decode(self.sock.recv())
                except msgspec.ValidationError:
                    continue  # Abort, Release, ...
                if isinstance(msg, Admit):
                    self.admits += 1
                    self.sock.send(encode(Granted(msg.request_id, list(range(-(-msg.num_tokens // BLOCK))), msg.admission)))
        self.sock.close()


@pytest.mark.parametrize("endpoint", ["bogus://nowhere", "tcp://127.0.0.1:notaport", ""])
def test_rogue_decode_worker_with_an_unusable_kv_endpoint(cluster, model_dir, endpoint):
    rogue = RogueDecode(cluster.plan.worker_addr, endpoint, str(model_dir))
    rogue.start()
    try:
        poll(lambda: "fz-rogue" in {w["id"] for w in stats(cluster)["workers"]}, timeout=10)
        with Client(cluster.plan.client_addr, timeout=30) as c:
            # the rogue has the most room, so it is picked; the hand-off to it fails with a typed error
            with pytest.raises(WorkerLost) as e:
                c.generate(token_ids=[5, 6, 7], temperature=0, max_tokens=2)
            assert e.value.code == "kv_transfer_failed"
        assert rogue.admits >= 1
    finally:
        rogue.stop.set()
        rogue.join(5)
    check_healthy(cluster)
