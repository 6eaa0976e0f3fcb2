"""The table of bounds on a launched service (coordinator, gateway, one colocated worker: real
processes on loopback, tiny model): the hostile requests of issue 22 are refused with 400
limit_exceeded naming the field (HTTP) or ErrorReply limit_exceeded (the coordinator's client
port, through the client library and a raw DEALER), and the next ordinary request is answered.

- a chat of 200,000 empty messages with n=4 (6.6 MB of JSON, "0 bytes" of text);
- /tokenize with chat_template_kwargs carrying the caller's own template ("PWNED" never rendered);
- a chat with a 1.2 MB JSON schema; /tokenize and /detokenize past their bounds; a trace header
  past its length;
- a 1 MiB request_id through the client library, a 300-character one, and 200,000 messages in a
  raw GenerateRequest.
At the end every KV block is free."""
import json

import httpx
import pytest
import zmq

from pdserve.wire.limits import RequestLimits
from pdserve_client.library import Client, InvalidRequest
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import ChatMessage, CoordinatorToClient, ErrorReply, GenerateRequest, decoder, encode
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

L = RequestLimits()
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=512)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, gateway=True,
                             http_port=free_port(), engine_args=["--kv-cache-mb", "8"])
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def url(cluster):
    return cluster.plan.http_url


def post(url, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=data, headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=60, **kw)


def assert_limit(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("limit_exceeded", param), err


def assert_served(url, model):
    r = post(url, "/v1/chat/completions", {"model": model, **HI})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_a_chat_of_200000_empty_messages_is_refused_and_the_next_request_is_answered(url, cluster):
    model = cluster.plan.model
    body = json.dumps({"model": model, "n": 4, "messages": [{"role": "user", "content": ""}] * 200_000}).encode()
    assert len(body) > 6_000_000
    assert_limit(post(url, "/v1/chat/completions", body), "messages")
    assert_served(url, model)
    # just past the count, a small body: the same refusal after decoding
    assert_limit(post(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ""}] * (L.max_messages + 1)}),
                 "messages")


def test_tokenize_never_renders_a_callers_template(url):
    pwned = "PWNED{% for m in messages %}{{ m.content }}{% endfor %}"
    r = post(url, "/tokenize", {"messages": HI["messages"], "chat_template_kwargs": {"chat_template": pwned}})
    assert_limit(r, "chat_template_kwargs")
    assert "PWNED" not in r.text
    r = post(url, "/tokenize", {"messages": HI["messages"], "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["count"] > 0  # a plain value passes
    assert_limit(post(url, "/tokenize", {"messages": [{"role": "user", "content": ""}] * 200_000}), "messages")
    assert_limit(post(url, "/tokenize", {"prompt": "x" * (L.max_prompt_bytes + 1)}), "prompt")
    assert_limit(post(url, "/detokenize", {"tokens": [1] * (L.max_token_ids + 1)}), "tokens")


def test_a_huge_json_schema_and_a_long_trace_header_are_refused(url, cluster):
    model = cluster.plan.model
    schema = {"type": "object", "description": "d" * 1_200_000, "properties": {"a": {"type": "string"}}}
    r = post(url, "/v1/chat/completions", {"model": model, **HI, "response_format": {"type": "json_schema",
                                                                                   "json_schema": {"name": "x", "schema": schema}}})
    assert_limit(r, "response_format")
    assert_limit(post(url, "/v1/chat/completions", {"model": model, **HI}, headers={"tracestate": "s" * (L.max_trace_header + 1)}),
                 "tracestate")
    assert_served(url, model)


def test_the_client_port_refuses_oversized_ids_and_messages(cluster):
    with Client(cluster.plan.client_addr, timeout=30) as c:
        for rid in ("i" * 2**20, "i" * (L.max_name_length + 1)):  # by the frame's lengths; by the decoded field
            with pytest.raises(InvalidRequest) as e:
                c.generate("hi", request_id=rid, max_tokens=2)
            assert e.value.code == "limit_exceeded" and "request_id" in e.value.message
        assert c.generate("hi", request_id="i" * L.max_name_length, max_tokens=2, temperature=0.0).completion_tokens >= 1

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cluster.plan.client_addr)
        try:
            sock.send(encode(GenerateRequest("many", SamplingParams(max_tokens=2), messages=[ChatMessage("user", "")] * 200_000)))
            assert sock.poll(30_000), "no answer"
            reply = decoder(CoordinatorToClient).decode(sock.recv())
            assert isinstance(reply, ErrorReply) and (reply.request_id, reply.code) == ("many", "limit_exceeded")
            assert "messages" in reply.message
        finally:
            sock.close()
        wait_all_blocks_free(c, timeout=10)



def test_aborts_and_status_queries_with_oversized_ids_are_dropped_unechoed(cluster):
    """No request has an id over the bound, so an AbortRequest or StatusRequest naming one is
    dropped and counted, never echoed back (a StatusRequest's unknown_request would be)."""
    from pdserve_client.protocol import AbortRequest, StatusRequest

    with Client(cluster.plan.client_addr, timeout=30) as c:
        before = c.stats()["requests"].get("oversized_ids_dropped", 0)
        long_id = "s" * (L.max_name_length + 1)
        c.sock.send(encode(StatusRequest(long_id)))
        c.sock.send(encode(AbortRequest(long_id)))
        c.sock.send(encode(StatusRequest("short")))  # a known-size id still gets its unknown_request
        reply = decoder(CoordinatorToClient).decode(c.sock.recv()) if c.sock.poll(10_000) else None
        assert isinstance(reply, ErrorReply) and (reply.request_id, reply.code) == ("short", "unknown_request"), reply
        assert c.stats()["requests"].get("oversized_ids_dropped", 0) == before + 2
