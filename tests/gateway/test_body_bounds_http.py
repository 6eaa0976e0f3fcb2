"""Request bodies are bounded in depth, in bytes held and in time (issue 38), through a launched
service (coordinator, gateway with --body-read-timeout 8, one colocated worker; tiny model):

- JSON nested past the decoders' recursion (a chat whose json_schema nests 3,000 levels, bodies of
  100,000 "[", inline and in the parse lane) is a 400 in OpenAI's error shape (limit_exceeded
  naming the field where one holds it), never a 500; a schema nested past max_json_depth but
  within what the decoder takes is refused by the bound, and one within it is served;
- 64 connections that each declare 8 MiB - 1 bytes, send all but 1 KiB and stall grow the
  gateway's RSS by less than 256 MiB (the body budget: 128 MiB by default), other clients are
  served while they stall, and each stalled body is answered: 408 with the connection closed 8 s
  after its read began (the budget's 16 bodies, then the 16 granted as they left), or 503 with
  Retry-After after waiting 8 s for room (the rest; the gateway then reads and drops the rest of
  the body, so the client sees the answer).

Before the change the 3,000-level schema was a 500 (plain text from the loop; internal_error from
the parse lane for a large body), and the 64 stalled bodies grew the gateway by 495 MiB in 40 s
(615 MiB in issue 38's measure) and none was answered; after it, +114 MiB and every one answered
within 2 x the timeout."""
import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from pdserve.gateway.config import BODY_BUDGET_BYTES
from pdserve.gateway.errors import MAX_BODY_BYTES
from pdserve.gateway.parse_lane import INLINE_BYTES
from pdserve.wire.limits import RequestLimits
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model, start_cluster

L = RequestLimits()
BODY_READ_TIMEOUT_S = 8.0
STALLED = 64
RSS_GROWTH = 256 * 2**20
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=512)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, gateway=True,
                             http_port=free_port(), engine_args=["--kv-cache-mb", "8"],
                             gateway_args=["--body-read-timeout", str(BODY_READ_TIMEOUT_S)])
    yield launcher
    launcher.stop()


def post(cluster, path: str, body: bytes | dict, timeout: float = 60) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{cluster.plan.http_url}{path}", content=data, headers={"content-type": "application/json"}, timeout=timeout)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}, with this status (and code, param)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    assert code is None or (err["code"], err["param"]) == (code, param), err
    return err


def nested_schema(levels: int) -> str:
    """A JSON schema of `levels` objects each holding the next as its property (2 JSON levels each), as text."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def schema_chat(model: str, schema: str) -> bytes:
    return ('{"model":%s,"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"response_format":'
            '{"type":"json_schema","json_schema":{"name":"deep","schema":%s}}}' % (json.dumps(model), schema)).encode()


def assert_served(cluster) -> None:
    r = post(cluster, "/v1/chat/completions", {"model": cluster.plan.model, "messages": HI, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_json_nested_past_the_decoder_is_a_400_in_openais_shape(cluster):
    model = json.dumps(cluster.plan.model)
    assert_error(post(cluster, "/v1/chat/completions", schema_chat(cluster.plan.model, nested_schema(3000))), 400,
                 "limit_exceeded", "response_format")
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/responses"):
        assert_error(post(cluster, path, deep), 400)  # a body that is not an object: no field to name
    chat = b'{"model":%s,"messages":%s}' % (model.encode(), deep)
    assert_error(post(cluster, "/v1/chat/completions", chat), 400, "limit_exceeded", "messages")
    big = b'{"model":%s,"prompt":%s}' % (model.encode(), b"[" * (INLINE_BYTES + 1) + b"]" * (INLINE_BYTES + 1))
    assert len(big) > INLINE_BYTES  # decoded in the parse lane's child
    assert_error(post(cluster, "/v1/completions", big), 400, "limit_exceeded", "prompt")
    assert_served(cluster)


def test_a_schema_past_max_json_depth_is_refused_and_one_within_is_served(cluster):
    model = cluster.plan.model
    past = L.max_json_depth // 2 + 1  # 2 levels a schema level, 1 for the innermost
    assert_error(post(cluster, "/v1/chat/completions", schema_chat(model, nested_schema(400))), 400, "limit_exceeded", "response_format")
    assert_error(post(cluster, "/v1/chat/completions", schema_chat(model, nested_schema(past))), 400, "limit_exceeded", "response_format")
    as_text = {"model": model, "messages": HI, "max_tokens": 2, "guided_json": nested_schema(600)}  # json.loads recurses on it
    assert_error(post(cluster, "/v1/chat/completions", as_text), 400, "limit_exceeded", "guided_json")
    tool = {"type": "function", "function": {"name": "f", "parameters": json.loads(nested_schema(past))}}
    assert_error(post(cluster, "/v1/chat/completions", {"model": model, "messages": HI, "tools": [tool]}), 400, "limit_exceeded", "tools")
    r = post(cluster, "/v1/chat/completions", schema_chat(model, nested_schema(past - 2)))  # 2 x 31 + 1 = 63 levels
    assert r.status_code == 200, r.text


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def stall(port: int, answers: dict, i: int) -> None:
    """Declare an 8 MiB - 1 byte body, send all of it but 1 KiB, stall; record (status, error body, head,
    whether the gateway closed the connection after its answer) or why no answer came."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(BODY_READ_TIMEOUT_S + 60)
    size = MAX_BODY_BYTES - 1
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % size)
        try:
            s.sendall(b" " * (size - 1024))
        except OSError:
            pass  # answered and closed while the gateway held the rest unread: the answer may still be in our buffer
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")))
        while len(body) < length and (chunk := s.recv(65536)):
            body += chunk
        status = int(head.split(b" ", 2)[1])
        s.settimeout(5)
        closed = status == 408 and s.recv(1) == b""  # (a 503 leaves it open: the gateway reads and drops the rest)
        answers[i] = (status, json.loads(body), head.lower(), closed)
    except (OSError, StopIteration, ValueError) as e:
        answers[i] = (None, None, repr(e).encode(), None)
    finally:
        s.close()


def test_stalled_bodies_hold_a_bounded_budget_and_are_answered_by_their_deadline(cluster):
    pid = dict(cluster.procs)["gateway"].pid
    assert_served(cluster)
    assert_error(post(cluster, "/v1/completions", b'{"model": 1, "prompt": "%s"}' % (b"x" * 2**20)), 400)  # a large body through the lane
    rss0 = rss(pid)
    answers, peak = {}, [rss0]
    threads = [threading.Thread(target=stall, args=(cluster.plan.http_port, answers, i), daemon=True) for i in range(STALLED)]
    started = time.monotonic()
    for t in threads:
        t.start()

    def watch():
        while any(t.is_alive() for t in threads):
            peak.append(rss(pid))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # the budget's worth of bodies has arrived (and stalls): then other clients are still served
    poll(lambda: max(peak) - rss0 > BODY_BUDGET_BYTES // 2, timeout=BODY_READ_TIMEOUT_S - 2, every=0.05)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        served = ex.submit(assert_served, cluster)
        health = ex.submit(lambda: httpx.get(f"{cluster.plan.http_url}/health", timeout=30).status_code)
        served.result()
        assert health.result() == 200
    assert not answers, f"a stalled body was answered before the others were served: {answers}"
    for t in threads:
        t.join(BODY_READ_TIMEOUT_S + 60)
    watcher.join(5)
    took = time.monotonic() - started
    grew = max(peak) - rss0
    statuses = sorted(str(a[0]) for a in answers.values())
    print(f"gateway RSS {rss0 / 2**20:.0f} MiB, peak +{grew / 2**20:.0f} MiB; answers {statuses} in {took:.1f} s")
    assert grew < RSS_GROWTH, f"the gateway grew by {grew / 2**20:.0f} MiB"
    assert len(answers) == STALLED and took < 2 * BODY_READ_TIMEOUT_S + 30
    timed_out = [a for a in answers.values() if a[0] == 408]
    assert len(timed_out) >= BODY_BUDGET_BYTES // MAX_BODY_BYTES - 1, statuses  # the bodies the budget held were being read
    assert any(a[0] == 503 for a in answers.values()), statuses  # the rest waited for room no longer than the timeout
    for status, body, head, closed in answers.values():
        if status is None:  # refused while its unread bytes sat in the gateway's socket: the reset can beat the answer
            assert b"reset" in head or b"broken pipe" in head, head
            continue
        assert status in (408, 503), (status, body)
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == {408: "body_read_timeout", 503: "server_busy"}[status]
        if status == 408:
            assert b"connection: close" in head and closed, head
        else:
            assert b"retry-after: 1" in head, head
    assert_served(cluster)
