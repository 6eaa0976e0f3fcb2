"""The OpenAI-compatible gateway against a launched service (coordinator, gateway, one prefill and
one decode worker: real processes on loopback), driven by the official `openai` package, sync
and async, streaming and not. Greedy answers equal the coordinator's own; usage matches the
tokenizer; seeds reproduce; stop strings cut; n > 1 fans out; each error arrives as the
matching openai exception; a client that leaves mid-request aborts it and every block is
freed; /metrics parses and moves.

The model is tiny and random with a 2048-token context; each worker's KV pool is 96 blocks of
16 tokens (1536 tokens), so a 1700-token prompt fits the context but never the pool: the
coordinator holds it, waiting for room, until --pending-timeout (2 s) and sheds it as
`overloaded` (or earlier as `slo_unattainable`, when it predicts the TTFT target missed): a 429."""
import asyncio
import shutil
import threading
import time

import httpx
import openai
import pytest

from pdserve.common.tokenizer import load_tokenizer, render_chat
from pdserve_client.library import Client
from tests.gateway.helpers import exposition_problems, poll, promtool_check, scrape, start_gateway_cluster, value
from tests.helpers import save_tiny_served_model, wait_all_blocks_free

CONTEXT = 2048
NUM_BLOCKS = 96
MAX_ACTIVE = 8  # requests in flight before the coordinator sheds
SERVED = NUM_BLOCKS * 16  # the context the launch serves: what one pool holds, below the model's (issue 40)
PENDING_TIMEOUT = 2.0
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=CONTEXT)
    return d


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    launcher = start_gateway_cluster(model_dir, tmp_path_factory.mktemp("logs"), engine_args=["--num-blocks", str(NUM_BLOCKS)],
                                     # requests wait for KV room (PENDING_TIMEOUT), past MAX_ACTIVE in flight they are shed
                                     coordinator_args=["--no-slo", "--pending-timeout", str(PENDING_TIMEOUT), "--max-active-requests", str(MAX_ACTIVE)])
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir.name


@pytest.fixture
def client(service):
    with openai.OpenAI(base_url=f"{service.plan.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def coordinator(service) -> Client:
    return Client(service.plan.client_addr, timeout=60)


def greedy(client, model, prompt, n_tokens, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0, extra_body=NO_EOS, **kw)


# ------------------------------------------------------------------ models, health, schema


def test_models_health_and_openapi(service, client, model, model_dir):
    # /health answers from a summary refreshed once a second: right after the launch it may still
    # count only the worker that registered first (200 already: a decode worker serves alone)
    expected = {"status": "ready", "workers": {"prefill": 1, "decode": 1}}
    health = poll(lambda: (r := httpx.get(f"{service.plan.http_url}/health", timeout=10)).status_code == 200 and r.json() == expected and r,
                  timeout=5)
    assert health.json() == expected
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].root == models[0].id and str(model_dir) not in str(models) and models[0].max_model_len == SERVED and models[0].owned_by == "pdserve"
    doc = httpx.get(f"{service.plan.http_url}/openapi.json", timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize", "/version",
            "/openapi.json", "/v1/responses", "/v1/responses/{response_id}", "/health/ready", "/v2/health/live",
            "/v2/health/ready"} == set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["required"] and "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "ignore_eos" in schemas["ChatCompletionRequest"]["properties"]


# ------------------------------------------------------------------ completions and chat


def test_completion_equals_coordinator_and_usage_matches_tokenizer(service, client, model, tok):
    prompt = "The quick brown fox"
    r = greedy(client, model, prompt, 8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model
    assert abs(r.created - time.time()) < 120
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(tok.encode(prompt)), 8, len(tok.encode(prompt)) + 8)
    with coordinator(service) as c:
        direct = c.generate(prompt, temperature=0, max_tokens=8, ignore_eos=True)
    assert choice.text == direct.text and choice.text


def test_chat_equals_coordinator_and_usage_matches_template(service, client, model, tok):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6, temperature=0, extra_body=NO_EOS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(render_chat(tok, messages)) and r.usage.completion_tokens == 6
    with coordinator(service) as c:
        direct = c.generate(messages=messages, temperature=0, max_tokens=6, ignore_eos=True)
    assert choice.message.content == direct.text
    # A content-part list is the same message; "developer" is OpenAI's newer name for "system".
    parts = [{"role": "developer", "content": [{"type": "text", "text": "You are terse."}]}, messages[1]]
    again = client.chat.completions.create(model=model, messages=parts, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert again.choices[0].message.content == direct.text and again.usage.prompt_tokens == r.usage.prompt_tokens


def test_streaming_completion_equals_whole(service, client, model):
    prompt = "In the beginning"
    whole = greedy(client, model, prompt, 10).choices[0].text
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body=NO_EOS, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == whole
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # The wire format itself: server-sent events ending in `data: [DONE]`.
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{service.plan.http_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_async_streaming_chat_concurrent(service, client, model):
    prompts = ["Hello!", "What is 2+2?", "Tell me a story.", "Bonjour"]
    expected = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=7, temperature=0,
                                               extra_body=NO_EOS).choices[0].message.content for p in prompts]

    async def one(c, p):
        stream = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=7, temperature=0,
                                                 extra_body=NO_EOS, stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{service.plan.http_url}/v1", api_key="unused", max_retries=0) as c:
            whole = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[0]}], max_tokens=7,
                                                    temperature=0, extra_body=NO_EOS)
            return whole.choices[0].message.content, await asyncio.gather(*(one(c, p) for p in prompts))

    whole, streamed = asyncio.run(main())
    assert whole == expected[0]
    assert streamed == expected


def test_seed_reproduces_and_differs(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body=NO_EOS).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c


def test_stop_strings(client, model):
    prompt = "The weather today is"
    full = greedy(client, model, prompt, 24).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.find(stop)]
    r = greedy(client, model, prompt, 24, stop=[stop, "never-appears-0x1f"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=stop, extra_body=NO_EOS,
                                            stream=True))
    assert "".join(ch.text for c in chunks for ch in c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_prompt_lists(client, model, tok):
    prompt = "A list of fruits:"
    kw = dict(model=model, max_tokens=6, temperature=1.0, seed=7, extra_body=NO_EOS)
    r = client.completions.create(prompt=prompt, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 18  # the prompt counts once
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1  # seed + i per choice
    assert [c.text for c in client.completions.create(prompt=prompt, n=3, **kw).choices] == texts
    # Streaming n=2 chat gives the same choices as the whole response, told apart by index.
    msgs = [{"role": "user", "content": "Pick a number."}]
    whole = client.chat.completions.create(messages=msgs, n=2, **kw)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(messages=msgs, n=2, stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == {c.index: c.message.content for c in whole.choices}
    # A batch of prompts: choice index = prompt index * n + sample.
    batch = client.completions.create(prompt=["One", "Two"], n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    single = client.completions.create(prompt="Two", **kw)
    assert batch.choices[2].text == single.choices[0].text


def test_token_id_prompts_and_logprobs(client, model):
    ids = [100, 2000, 345, 6789, 42]
    r = greedy(client, model, ids, 6, logprobs=3)
    assert r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    batch = greedy(client, model, [ids, ids[:3]], 2)
    assert [c.text for c in batch.choices][0] == greedy(client, model, ids, 2).choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and bytes(t.bytes) == t.token.encode() for t in content)
    streamed = [t for c in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                                          temperature=0, logprobs=True, extra_body=NO_EOS, stream=True)
                for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


# ------------------------------------------------------------------ errors


def test_errors_arrive_as_openai_exceptions(service, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert e.value.code == "model_not_found"
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(n=0), dict(logprobs=21),
                dict(extra_body={"max_tokens": "many"}), dict(extra_body={"logit_bias": {"5": 1.0}})):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="hi", **bad)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert e.value.code == "invalid_sampling_params" and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"max_tokens": "many"})
    assert e.value.body["param"] == "max_tokens"
    raw = httpx.post(f"{service.plan.http_url}/v1/completions", content=b"{not json", timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=[5] * (SERVED + 10), stream=stream)
        assert e.value.code == "prompt_too_long" and f"context is {SERVED}" in e.value.message


def test_a_prompt_over_what_the_pool_holds_is_over_the_context(service, client, model):
    """The model's context is 2048 tokens but a worker's pool holds 1536 (96 blocks of 16): the
    launch serves a 1536-token context (issue 40: known at start), so a longer prompt is refused at
    once as over the context (before: admitted, it waited for room no worker had, then a 429)."""
    assert client.models.list().data[0].max_model_len == SERVED
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[7] * (SERVED + 100), max_tokens=1)
    assert e.value.code == "prompt_too_long" and f"context is {SERVED}" in e.value.message


def test_shed_request_is_429_with_retry_after(service, client, model):
    """Over --max-active-requests (8 here) a request is shed at once with a 429 and Retry-After."""
    with streams_running(client, model, MAX_ACTIVE, prompt_len=16):
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=model, prompt=[7] * 10, max_tokens=1)
    assert e.value.code == "overloaded" and e.value.response.headers["retry-after"] == "1"
    assert greedy(client, model, "still serving", 2).usage.completion_tokens == 2


class streams_running:
    """`count` greedy streams of `prompt_len`-token prompts, each run to the served context, all
    started (a token received from each) inside the block; leaving it stops reading them and
    closes them, which aborts them."""

    def __init__(self, client, model, count: int, prompt_len: int):
        self.client, self.model, self.count, self.prompt_len = client, model, count, prompt_len
        self.started, self.leave = threading.Semaphore(0), threading.Event()

    def run(self, i: int):
        with self.client.completions.create(model=self.model, prompt=[9 + i] * self.prompt_len, max_tokens=SERVED - self.prompt_len - 1,
                                            temperature=0, extra_body=NO_EOS, stream=True) as stream:
            for n, _ in enumerate(stream):
                if n == 0:
                    self.started.release()
                if self.leave.is_set():
                    break

    def __enter__(self):
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(self.count)]
        for t in self.threads:
            t.start()
        for _ in self.threads:
            assert self.started.acquire(timeout=60), "a stream never started"
        return self

    def __exit__(self, *exc):
        self.leave.set()
        for t in self.threads:
            t.join(60)


# ------------------------------------------------------------------ disconnects


def test_disconnect_mid_stream_aborts_and_frees_every_block(service, client, model):
    with coordinator(service) as c:
        aborted0 = c.stats()["requests"].get("finished:abort", 0)
        got = []
        with client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to a thousand."}], n=2,
                                            max_tokens=1200, temperature=0, extra_body=NO_EOS, stream=True) as stream:
            for chunk in stream:
                got += [ch.delta.content for ch in chunk.choices if ch.delta.content]
                if len(got) >= 4:
                    break
        assert len(got) >= 4
        # both choices end as aborts; >= and 10 s: on a loaded 2-core CI machine this once timed out
        # at == within 5 s (seen once in six full runs); the block and request checks below stay exact
        poll(lambda: c.stats()["requests"].get("finished:abort", 0) >= aborted0 + 2 or None, timeout=10.0)
        stats = wait_all_blocks_free(c, timeout=5.0)
        assert stats["active_requests"] == 0
        assert all(w["inflight"] == 0 for w in stats["workers"])


def test_disconnect_while_waiting_aborts(service, client, model):
    """A non-streaming client that gives up (here: while its request waits for KV room: 6 streams
    hold 6 x 15 and more of the decode pool's 96 blocks, its prompt needs 63) aborts it."""
    with coordinator(service) as c:
        before = c.stats()["requests"]
        with streams_running(client, model, 6, prompt_len=240):
            with pytest.raises(openai.APITimeoutError):
                client.with_options(timeout=0.5).completions.create(model=model, prompt=[7] * 1000, max_tokens=1)
            waiting = poll(lambda: (s := c.stats())["pending"] == 0 and s["active_requests"] == 6 and s)  # it left the queue: aborted
            assert waiting["requests"].get("finished:abort", 0) == before.get("finished:abort", 0) + 1
        stats = poll(lambda: (s := c.stats())["active_requests"] == 0 and s)  # the streams closed: aborted too
        assert stats["requests"].get("finished:abort", 0) == before.get("finished:abort", 0) + 7
        assert stats["requests"].get("error:overloaded", 0) == before.get("error:overloaded", 0)  # aborted, not shed
        assert wait_all_blocks_free(c, timeout=10.0)["active_requests"] == 0


# ------------------------------------------------------------------ metrics


def test_metrics_parse_and_move(service, client, model, tok):
    url = service.plan.http_url
    before, types = scrape(url)
    assert types["pdserve_time_to_first_token_seconds"] == "histogram" and types["pdserve_request_success"] == "counter"
    assert types["pdserve_kv_cache_usage_perc"] == "gauge" and types["pdserve_num_requests_running"] == "gauge"
    prompt = "Metrics are"
    greedy(client, model, prompt, 5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=prompt, top_p=0)

    def handed_off():  # the hand-off is reported by the prefill worker, apart from the tokens
        s = scrape(url)[0]
        return s if value(s, "pdserve_kv_transfer_handoffs_total") > value(before, "pdserve_kv_transfer_handoffs_total") else None

    after = poll(handed_off)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("pdserve_request_success_total", finished_reason="length", model_name=model) == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds", "request_prompt_tokens"):
        assert moved(f"pdserve_{h}_count") == 1, h
    assert moved("pdserve_inter_token_latency_seconds_count") == 4
    assert moved("pdserve_generation_tokens_total") == 5 and moved("pdserve_prompt_tokens_total") == len(tok.encode(prompt))
    assert moved("pdserve_request_errors_total", error_type="invalid_sampling_params") == 1
    assert moved("pdserve_kv_transfer_bytes_total") > 0 and moved("pdserve_kv_transfer_seconds_total") > 0
    assert value(after, "pdserve_coordinator_up") == 1
    assert value(after, "pdserve_num_workers", role="prefill") == 1 and value(after, "pdserve_num_workers", role="decode") == 1
    usage = {dict(ls)["worker"]: v for (n, ls), v in after.items() if n == "pdserve_kv_cache_usage_perc"}
    assert set(usage) == {"t-prefill-0", "t-decode-0"} and all(0 <= v <= 1 for v in usage.values())
    assert ("pdserve_num_requests_waiting", (("model_name", model), ("role", "decode"), ("worker", "t-decode-0"))) in after
    # SLO windows: the coordinator's own p99 TTFT of priority class 0 and its targets
    assert value(after, "pdserve_slo_ttft_p99_seconds", priority="0") > 0
    assert value(after, "pdserve_slo_ttft_target_seconds") > 0 and types["pdserve_slo_tpot_p99_seconds"] == "gauge"


def served_metrics(service, client, model) -> str:
    """/metrics as text after a request: the histograms, SLO windows and hand-off counters have samples."""
    greedy(client, model, "Rules are", 3)
    text = httpx.get(f"{service.plan.http_url}/metrics", timeout=10).text
    assert 'pdserve_slo_ttft_p99_seconds{model_name="' in text and "pdserve_e2e_request_latency_seconds_bucket{" in text
    return text


def test_metrics_keep_the_rules_promtool_checks(service, client, model):
    assert exposition_problems(served_metrics(service, client, model)) == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not on PATH (Debian's prometheus package has it: "
                    "`apt-get download prometheus && dpkg-deb -x prometheus_*.deb x` gives x/usr/bin/promtool)")
def test_metrics_pass_promtool(service, client, model):
    status, out = promtool_check(served_metrics(service, client, model))
    assert status == 0, out


def test_every_phase_move_of_this_modules_traffic_is_in_the_table(service, client, model):
    """Run last: the streams, aborts, disconnects and refusals above moved requests only as
    coordinator/state.py's TRANSITIONS allows (a move outside it is counted illegal_transitions)."""
    greedy(client, model, "one more", 2)
    with coordinator(service) as c:
        counts = c.stats()["requests"]
    assert counts.get("requests", 0) >= 1 and counts.get("illegal_transitions", 0) == 0, counts
