"""No single request can slow, leak or take over the node (issue 22): through `pdserve launch` with
its defaults (disaggregated, SLO control on, no API key; a tiny random model on a small 8 MiB KV
pool), a corpus of hostile requests arrives at the HTTP gateway and straight at the coordinator
while a greedy probe stream runs and a short request arrives once a second. The hostile client runs
in its own process at a lower CPU priority: on a deployment its CPU is not the server's, and here
its own JSON and HTTP work would otherwise take the server's two cores (with it in the test's
process a short request's TTFT reached 60-140 ms during the rounds; niced, 12-33 ms against 17-19 idle).

Asserted: each hostile request is refused (a typed error) or served within its bound; the probe's
worst gap stays within max(5 x its median gap, median + 250 ms); every short request's TTFT stays
within the same stall bound of its idle value (the median of the short requests sent with the
probe running before the corpus): max(5 x idle, idle + 250 ms); the coordinator's and gateway's
RSS grow by at most 64 MiB; every pool is whole at the end.

Round four (issue 38) adds to the corpus a json_schema nested 3,000 levels, a body of 100,000 "[",
a scoring request asking 8 prompts x 4,000 ids x n=128 of prompt scores (refused by
max_scored_entries), a schema pattern `.{0,100000}` (refused: counted repetitions past 128,
runtime/structured.py) and a string of maxLength 100,000 (served, within 10 s: its mask is cheap), and
then 64 connections that each declare an 8 MiB body, send all but 1 KiB and stall (the probe and
the short requests still running; beside the rounds they would only make the corpus's large bodies
wait their turn, a 503 by design): each is answered (408 or 503 by --body-read-timeout, 5 s here)
and the gateway's peak RSS grows by less than 256 MiB while they stall. Not in the corpus: prompt_logprobs 20 on a 2,000-token
prompt, a legal request (served: tests/gateway/test_large_scores.py) whose chunked prefill (256
tokens a step, vocab-wide scores) shares the probe's decode worker and delayed its tokens 0.36-0.52 s
in four runs here on the loaded 2-core machine (docs/security.md).

The short requests' bound was 2 x idle + 50 ms until a CI run on a shared 2-core machine saw one
of 15 at 118 ms against an idle 17 ms (every other within 39 ms, the probe's gaps in bound): that
bound measured the machine's scheduling noise, not a stall. The attack this guards against held
every new request for 10 s; a stall is what both bounds catch, and the TTFTs are printed.
"""
import collections
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import threading
import time

import httpx
import pytest

from pdserve_client.library import Client
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import CoordinatorToClient, ErrorReply, GenerateRequest, decoder, encode
from tests.faults.probe import Probe, client_socket, launched
from tests.gateway.helpers import poll
from tests.gateway.test_body_bounds_http import nested_schema, schema_chat, stall
from tests.helpers import wait_all_blocks_free

GAP_FACTOR, GAP_SLACK_S = 5.0, 0.25
RSS_GROWTH = 64 * 2**20
REFUSE_S = 1.0  # a refusal of a request over a bound
# a served case's bound, alone (the rest are refused)
SERVE_S = {"chat: json_schema maxLength 100,000": 10.0}
STALLED_BODIES, BODY_READ_TIMEOUT_S = 64, 5.0  # 8 MiB bodies that stall, all the rounds long; the launch's --body-read-timeout
BODY_RSS_GROWTH = 256 * 2**20  # the gateway's peak growth while they stall (its body budget is 128 MiB)
ROUNDS = 8  # the corpus one at a time, then all at once, then the health probes: ~1 s a round
HEALTH_PROBES = 50  # at once, each round (tests/gateway/test_cheap_health_and_slow_reader.py floods 300)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with launched(tmp_path_factory, "--engine-arg=--kv-cache-mb=8", "--body-read-timeout", str(BODY_READ_TIMEOUT_S)) as n:
        # one structured request first: the gateway's grammar checker and the worker's compile probe start on first use
        # (xgrammar and torch imported: seconds, outside any request's budget; docs/security.md) and the bounds are the
        # steady state's
        r = httpx.post(f"{n['url']}/v1/chat/completions", timeout=120, json={
            "model": n["model"], "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "string"}}}})
        assert r.status_code == 200, r.text
        yield n


def children(pid: int) -> dict[str, int]:
    """The launcher's coordinator and gateway processes by role (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        for role in (b"coordinator", b"gateway"):
            if role in cmd:
                found[role.decode()] = int(entry)
    return found


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class PeakRss:
    """The highest RSS of a process, sampled every 50 ms on a thread until `stop` is set."""

    def __init__(self, pid: int):
        self.value, self.stop = rss(pid), threading.Event()
        threading.Thread(target=self._watch, args=(pid,), daemon=True).start()

    def _watch(self, pid: int) -> None:
        while not self.stop.wait(0.05):
            self.value = max(self.value, rss(pid))


def send_shorts(url: str, model: str, stop, done, conn) -> None:
    """Once a second a short streamed completion (`done` counts them); sends [(sent at, TTFT or None, error)] on conn."""
    body = {"model": model, "prompt": "Hello there", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    out = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            ttft, error = None, None
            try:
                with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if ttft is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                            ttft = time.monotonic() - t0
                    if r.status_code != 200:
                        error = f"status {r.status_code}"
            except Exception as e:
                error = repr(e)
            out.append((t0, ttft, error))
            done.value += 1
            stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))
    conn.send(out)


class Shorts:
    def __init__(self, url: str, model: str):
        mp = multiprocessing.get_context("spawn")
        self.stop = mp.Event()
        self.done = mp.Value("i", 0)
        self.conn, child = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=send_shorts, args=(url, model, self.stop, self.done, child), daemon=True)

    def start(self):
        self.proc.start()

    def finish(self) -> list:
        self.stop.set()
        assert self.conn.poll(60), "the short requests did not report"
        out = self.conn.recv()
        self.proc.join(10)
        return out


def direct(clients: str, msg, read: bool = True):
    """Send one message straight to the coordinator's client port; its first answer (or None)."""
    data = encode(msg)

    def send():
        s = client_socket(clients)
        try:
            s.send(data)
            return decoder(CoordinatorToClient).decode(s.recv()) if s.poll(30_000) else None
        finally:
            s.close()
    return send


def http(url: str, path: str, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lambda: httpx.post(f"{url}{path}", content=data, headers={"content-type": "application/json"}, timeout=60)


SPANS: list = []  # (name or "", start, end) of every request the hostile client sent (CLOCK_MONOTONIC): what ran at a gap


def timed(fn, name: str = ""):
    t0 = time.monotonic()
    reply = fn()
    SPANS.append((name, t0, time.monotonic()))
    return reply, SPANS[-1][2] - t0


def refused(r, code: str = "limit_exceeded") -> bool:
    return r.status_code == 400 and r.json()["error"]["code"] == code


def hostile_corpus(url: str, model: str, clients: str) -> dict:
    """name -> (send it: the reply, is the reply what the bounds promise)."""
    huge_schema = {"type": "object", "description": "d" * 1_200_000, "properties": {"a": {"type": "string"}}}
    return {
        # the two reproduced attacks
        "chat: 200,000 empty messages, n=4": (http(url, "/v1/chat/completions", {
            "model": model, "n": 4, "max_tokens": 2, "messages": [{"role": "user", "content": ""}] * 200_000}), refused),
        "tokenize: caller's chat_template": (http(url, "/tokenize", {
            "model": model, "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": "PWNED{% for m in messages %}{{ m.content }}{% endfor %}"}}), refused),
        "client: 1 MiB request_id": (direct(clients, GenerateRequest("i" * 2**20, SamplingParams(max_tokens=2), prompt="hi")),
                                     lambda r: isinstance(r, ErrorReply) and r.code == "limit_exceeded"),
        "chat: JSON schema with a 1.2 MB description": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": huge_schema}}}), refused),
        "client: regex spec of 1 MiB": (direct(clients, GenerateRequest("rx", SamplingParams(
            max_tokens=2, structured=StructuredOutput("regex", "a" * 2**20)), prompt="hi")),
            lambda r: isinstance(r, ErrorReply) and r.code == "limit_exceeded"),
        "client: 64 KiB trace header": (direct(clients, GenerateRequest("tr", SamplingParams(max_tokens=2), prompt="hi",
                                                                        trace_headers={"traceparent": "0" * 65536})),
                                        lambda r: isinstance(r, ErrorReply) and r.code == "limit_exceeded"),
        "chat: 100,000 content parts": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}),
            refused),
        "completions: 100,000 prompts": (http(url, "/v1/completions", {"model": model, "max_tokens": 2, "prompt": ["a"] * 100_000}),
                                         refused),
        "completions: top logprobs 1000": (http(url, "/v1/completions", {"model": model, "max_tokens": 2, "prompt": "a", "logprobs": 1000}),
                                           lambda r: r.status_code == 400),
        "detokenize: 2,000,000 ids": (http(url, "/detokenize", {"model": model, "tokens": [1] * 2_000_000}), refused),
        "chat: choice of 100,000 options": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}), refused),
        "tokenize: template kwarg holding a dict": (http(url, "/tokenize", {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": {"y": [1] * 1000}}}), refused),
        "chat: user string of 1 MiB": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "user": "u" * 2**20}), refused),
        # round four (issue 38); then the 64 stalled 8 MiB bodies (send_corpus)
        "chat: json_schema nested 3,000 levels": (http(url, "/v1/chat/completions", schema_chat(model, nested_schema(3000))), refused),
        "completions: a body of 100,000 '['": (http(url, "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
                                                 lambda r: r.status_code == 400 and "error" in r.json()),
        "completions: 8 prompts of 4,000 ids, n=128, echo, prompt_logprobs": (http(url, "/v1/completions", {
            "model": model, "max_tokens": 1, "n": 128, "echo": True, "logprobs": 1, "prompt_logprobs": 20,
            "prompt": [[100 + i + j % 1000 for j in range(4000)] for i in range(8)]}), refused),
        "chat: json_schema pattern .{0,100000}": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": ".{0,100000}"}}}}), refused),
        "chat: json_schema maxLength 100,000": (http(url, "/v1/chat/completions", {
            "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "m", "schema": {"type": "string", "maxLength": 100_000}}}}),
            lambda r: r.status_code == 200),
    }


def send_corpus(url: str, model: str, clients: str, conn) -> None:
    """The hostile client, in its own process at a lower CPU priority (on a real deployment the
    attacker's CPU is not the server's; on this 2-core machine its JSON encoding and HTTP client
    would otherwise compete with the server it attacks): ROUNDS rounds of the corpus one at a
    time, then all at once, then HEALTH_PROBES /health probes at once. Sends, per request name,
    whether every reply was as promised and the slowest time (one at a time, together), the
    health statuses seen, and when each round began (CLOCK_MONOTONIC)."""
    os.nice(10)
    corpus = hostile_corpus(url, model, clients)
    alone, together, health, rounds, stalled = {}, {}, set(), [], {}

    def keep(into, name, reply, took):
        ok, slowest, text = into.get(name, (True, 0.0, ""))
        good = corpus[name][1](reply)
        into[name] = (ok and good, max(slowest, took), text if good else f"{getattr(reply, 'text', reply)!s:.300}")

    with concurrent.futures.ThreadPoolExecutor(len(corpus)) as pool, httpx.Client(timeout=10) as probes:
        for _ in range(ROUNDS):
            rounds.append(time.monotonic())
            for name, (fn, _) in corpus.items():
                keep(alone, name, *timed(fn, name))
            futures = {name: pool.submit(timed, fn, name) for name, (fn, _) in corpus.items()}
            for name, f in futures.items():
                keep(together, name, *f.result(timeout=120))
            health |= set(pool.map(lambda _: probes.get(f"{url}/health").status_code, range(HEALTH_PROBES)))
    port = int(url.rsplit(":", 1)[1])  # then the stalled bodies (beside the rounds they would only make the corpus's large bodies wait)
    stallers = [threading.Thread(target=stall, args=(port, stalled, i), daemon=True) for i in range(STALLED_BODIES)]
    for t in stallers:
        t.start()
    for t in stallers:
        t.join(4 * BODY_READ_TIMEOUT_S + 60)
    answers = sorted((a[0], a[3]) if a[0] else (None, a[2].decode()) for a in stalled.values())
    conn.send((alone, together, sorted(health), rounds, time.monotonic(), answers, SPANS))


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
def test_hostile_corpus_is_bounded_and_nobody_stalls(node):
    url, model, clients = node["url"], node["model"], node["clients"]
    roles = children(node["pid"])
    assert set(roles) == {"coordinator", "gateway"}, roles
    probe, shorts = Probe(url, model), Shorts(url, model)
    rss0 = {role: rss(pid) for role, pid in roles.items()}
    probe.start()
    poll(lambda: probe.count.value >= 30 or not probe.proc.is_alive(), timeout=60)
    shorts.start()
    poll(lambda: shorts.done.value >= 5 or not shorts.proc.is_alive(), timeout=60)  # 5 short requests before the corpus: the idle TTFT
    mp = multiprocessing.get_context("spawn")
    conn, child = mp.Pipe(duplex=False)
    sender = mp.Process(target=send_corpus, args=(url, model, clients, child), daemon=True)
    t_hostile = time.monotonic()
    peak = PeakRss(roles["gateway"])
    sender.start()
    assert conn.poll(300), "the hostile client did not finish"
    results, together, health, rounds, t_done, stalled, spans = conn.recv()
    peak.stop.set()
    sender.join(10)
    print("rounds began at (s):", [round(t - t_hostile, 2) for t in rounds])
    print("slowest (ms), one at a time:", {name: round(took * 1000) for name, (_, took, _) in results.items()})
    print("slowest (ms), all at once:", {name: round(took * 1000) for name, (_, took, _) in together.items()})
    n = probe.count.value
    poll(lambda: probe.count.value >= n + 30 or not probe.proc.is_alive(), timeout=60)
    sent = shorts.finish()
    probe.finish()
    assert probe.error is None, probe.error
    rss1 = {role: rss(pid) for role, pid in roles.items()}

    for name, (ok, took, text) in results.items():
        assert ok, f"{name}: {text}"
        assert took < SERVE_S.get(name, REFUSE_S), f"{name} took {took:.2f} s"
    print(f"stalled bodies: answers {collections.Counter(stalled)}; gateway peak RSS +{(peak.value - rss0['gateway']) / 2**20:.0f} MiB")
    assert len(stalled) == STALLED_BODIES and all(status in (408, 503) for status, _ in stalled), stalled
    assert peak.value - rss0["gateway"] < BODY_RSS_GROWTH
    for name, (ok, _, text) in together.items():
        assert ok, f"{name} (all at once): {text}"
    assert health == [200], health

    timed_gaps = probe.gaps()
    gaps = [g for _, g in timed_gaps]
    median, worst = statistics.median(gaps), max(gaps)
    bound = max(GAP_FACTOR * median, median + GAP_SLACK_S)
    at = timed_gaps[gaps.index(worst)][0] - t_hostile
    print(f"probe: {len(gaps)} gaps, median {median * 1000:.1f} ms, worst {worst * 1000:.1f} ms at {at:+.2f} s "
          f"(hostile phase 0..{t_done - t_hostile:.2f} s), bound {bound * 1000:.1f} ms")
    began = timed_gaps[gaps.index(worst)][0]
    print("in flight during the worst gap:", sorted({n for n, a, b in spans if a < began + worst and b > began}))
    assert worst <= bound, f"the probe stalled: worst gap {worst * 1000:.0f} ms at {at:+.2f} s"

    assert all(e is None and t is not None for _, t, e in sent), sent
    idle = statistics.median(t for t0, t, _ in sent if t0 < t_hostile)
    during = [(t0 - t_hostile, t) for t0, t, _ in sent if t_hostile <= t0 <= t_done]
    limit = max(GAP_FACTOR * idle, idle + GAP_SLACK_S)
    print(f"short requests: idle TTFT {idle * 1000:.1f} ms, during: {[(round(a, 1), round(t * 1000)) for a, t in during]}")
    assert during, "no short request was sent while the corpus ran"
    assert all(t <= limit for _, t in during), f"a short request's TTFT passed {limit * 1000:.0f} ms: {during}"

    for role in roles:
        grew = rss1[role] - rss0[role]
        print(f"{role} RSS {rss0[role] / 2**20:.0f} -> {rss1[role] / 2**20:.0f} MiB")
        assert grew <= RSS_GROWTH, f"{role} grew by {grew / 2**20:.0f} MiB"
    with Client(clients, timeout=30) as c:
        stats = wait_all_blocks_free(c, timeout=30)
        assert stats["active_requests"] == 0
