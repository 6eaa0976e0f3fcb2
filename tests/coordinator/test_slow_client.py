"""A client that stops reading cannot make the coordinator hold more than its send budget, through
real processes: a raw DEALER (which reads nothing) starts long generations and then floods
StatsRequests whose replies pile up (~100 MB of them without a budget). The coordinator's RSS stays
within +64 MiB of where it started, the slow client's requests end client_too_slow (stats counters)
and every KV block comes back, while another client is served meanwhile."""
import threading
import time

import pytest
import zmq

from pdserve_client.library import Client, build_request, encode_request
from pdserve_client.protocol import CoordinatorToClient, ErrorReply, StatsRequest, decoder, encode
from tests.faults.test_soak import rss_kib
from tests.gateway.helpers import poll
from tests.helpers import save_tiny_served_model, start_cluster, wait_all_blocks_free

BUDGET_KB = 4096
FLOOD = 12_000  # StatsRequests; each reply is ~2.5 KB: ~30 MB of them without a budget
REQUESTS = 6
RSS_SLACK_KIB = BUDGET_KB + 16 * 1024  # the budget and some noise; the flood's replies are twice that


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=1024)
    c = start_cluster(d, tmp_path_factory.mktemp("logs"), coordinator_args=["--client-send-budget-kb", str(BUDGET_KB)])
    yield c
    c.stop()


def test_a_client_that_stops_reading_is_held_to_its_budget_and_others_are_served(cluster):
    coord = next(p for name, p in cluster.procs if name == "coordinator")
    addr = cluster.plan.client_addr
    with Client(addr, timeout=60) as c:
        c.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)  # warm: the tokenizer, both workers
        before = c.stats()["requests"]
    base = rss_kib(coord.pid)
    slow = zmq.Context().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.connect(addr)
    peak = [base]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(coord.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    served = []
    try:
        for i in range(REQUESTS):
            req = build_request(None, None, [7 + i, 8, 9], {"max_tokens": 900, "ignore_eos": True}, f"slow-{i}")
            slow.send(encode_request(req))
        with Client(addr, timeout=60) as c:
            poll(lambda: c.stats()["active_requests"] >= REQUESTS, timeout=30)
        stats_request = encode(StatsRequest())
        other = threading.Thread(target=lambda: served.append(Client(addr, timeout=60).generate(
            token_ids=[11, 12, 13], max_tokens=8, ignore_eos=True)), daemon=True)
        other.start()
        for _ in range(FLOOD):
            slow.send(stats_request)
        with Client(addr, timeout=60) as c:
            counts = lambda: c.stats()["requests"]  # noqa: E731
            poll(lambda: counts().get("error:client_too_slow", 0) - before.get("error:client_too_slow", 0) == REQUESTS, timeout=60)
            # the flood is answered (or refused) to the end: the refusals stop growing
            last = [-1]
            poll(lambda: (n := counts().get("client_over_budget_messages", 0)) == last[0] or last.__setitem__(0, n), timeout=60, every=0.5)
            assert last[0] >= FLOOD // 2
            other.join(60)
            assert served and served[0].completion_tokens == 8 and served[0].finish_reason == "length"
            stats = wait_all_blocks_free(c, timeout=30)
            assert stats["active_requests"] == 0
    finally:
        done.set()
        watcher.join()
        slow.close(0)
    assert peak[0] - base < RSS_SLACK_KIB, f"coordinator RSS grew {(peak[0] - base) / 1024:.0f} MiB"
    assert coord.poll() is None


def test_one_request_over_the_budget_ends_alone(cluster):
    """The gateway is one client of the coordinator for every HTTP request, so a message over the
    client's budget ends only the request it belongs to: a client that does not read asks 48
    prompts' scores (prompt_logprobs 20 on 1,000 tokens: ~0.3 MB each, ~14 MB in all against its
    4 MiB budget) and a long generation. The scores that do not fit end their requests alone
    (client_too_slow); the rest, and the whole generation, are delivered once it reads (before, the
    first message over budget ended every request of the client)."""
    addr = cluster.plan.client_addr
    with Client(addr, timeout=60) as c:
        before = c.stats()["requests"].get("error:client_too_slow", 0)
    reader = zmq.Context().socket(zmq.DEALER)
    reader.setsockopt(zmq.LINGER, 0)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 4096)
    reader.connect(addr)
    prompt = [100 + j % 1000 for j in range(1000)]
    scoring = [f"scores-{i}" for i in range(48)]
    try:
        reader.send(encode_request(build_request(None, None, [7, 8, 9], {"max_tokens": 600, "ignore_eos": True}, "long")))
        for rid in scoring:
            reader.send(encode_request(build_request(None, None, prompt, {"max_tokens": 1, "prompt_logprobs": 20}, rid)))
        with Client(addr, timeout=60) as c:
            poll(lambda: c.stats()["requests"].get("error:client_too_slow", 0) > before, timeout=120, every=0.05)
            assert c.stats()["active_requests"] > 0  # the first request over budget ended alone: the others run on
            poll(lambda: c.stats()["active_requests"] == 0, timeout=120)
            too_slow = c.stats()["requests"].get("error:client_too_slow", 0) - before
        dec = decoder(CoordinatorToClient)
        got: dict[str, list] = {}
        while reader.poll(2000):
            msg = dec.decode(reader.recv())
            got.setdefault(msg.request_id, []).append(msg)
    finally:
        reader.close(0)
    ended = sorted(rid for rid, msgs in got.items() if isinstance(msgs[-1], ErrorReply))
    assert 1 <= too_slow == len(ended) < len(scoring), (too_slow, ended)
    assert all(rid in scoring and got[rid][-1].code == "client_too_slow" for rid in ended)
    for rid in set(scoring) - set(ended):
        assert sum(len(getattr(m, "prompt_logprobs", None) or []) for m in got[rid]) == len(prompt) - 1, rid
    assert type(got["long"][-1]).__name__ == "Final"
    assert sum(len(getattr(m, "token_ids", None) or []) for m in got["long"]) == 600
