"""The benchmark's arithmetic and inputs, without servers: vLLM's metric definitions on known
timings, the arrival process, the random and JSONL workloads, the shipped prompt set, and the
OpenAI stream parser on canned server-sent events."""
import asyncio
import json
import statistics
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pdserve.bench.backends import OpenAIBackend, Sampling
from pdserve.bench.metrics import RequestOutput, compute_metrics, format_metrics, parse_goodput, result_dict
from pdserve.bench.workloads import (
    BenchRequest,
    arrival_intervals,
    build_requests,
    length_range,
    read_jsonl,
    shipped_prompts_path,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from pdserve.common.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir))


# ------------------------------------------------------------------ metrics

def outputs():
    a = RequestOutput(prompt_len=10, output_tokens=5, success=True, ttft=0.100, itl=[0.01, 0.02, 0.03, 0.04], latency=0.200)
    b = RequestOutput(prompt_len=20, output_tokens=1, success=True, ttft=0.300, itl=[], latency=0.300)
    c = RequestOutput(prompt_len=30, output_tokens=3, success=True, ttft=0.050, itl=[0.5, 0.5], latency=1.050)
    failed = RequestOutput(prompt_len=40, error="boom")
    return [a, b, c, failed]


def test_metrics_follow_vllm_definitions():
    m = compute_metrics(outputs(), duration=2.0, slos_ms={"ttft": 200, "tpot": 100})
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (60, 9)  # a failed request counts for nothing
    assert m.request_throughput == pytest.approx(1.5) and m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    # TPOT = (e2e - ttft) / (n - 1), only where n > 1: a -> 25 ms, c -> 500 ms
    assert m.latency_ms["tpot"]["mean"] == pytest.approx(262.5)
    assert m.latency_ms["tpot"]["median"] == pytest.approx(262.5)
    assert m.latency_ms["ttft"]["median"] == pytest.approx(100.0)
    assert m.latency_ms["itl"]["mean"] == pytest.approx(1000 * 1.1 / 6)  # every gap of every request
    assert m.latency_ms["e2el"]["p99"] == pytest.approx(1000 * (0.300 + 0.98 * (1.050 - 0.300)), rel=1e-6)  # linear, rank 1.98 of 0..2
    # goodput: a meets both SLOs; b (TPOT counted 0 with one token) misses TTFT; c misses TPOT
    assert m.request_goodput == pytest.approx(0.5)
    assert compute_metrics(outputs(), 2.0).request_goodput is None


def test_report_has_vllm_lines_in_order_and_json_has_flat_keys():
    m = compute_metrics(outputs(), 2.0, {"e2el": 250}, max_concurrency=4)
    text = format_metrics(m)
    order = ["Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
             "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
             "Output token throughput (tok/s):", "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
             "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 ITL (ms):",
             "Mean E2EL (ms):", "P99 E2EL (ms):"]
    positions = [text.index(label) for label in order]
    assert positions == sorted(positions)
    d = result_dict(m, outputs(), {"backend": "x"})
    assert d["backend"] == "x" and d["completed"] == 3 and d["total_output_tokens"] == 9
    assert d["p99_ttft_ms"] == m.latency_ms["ttft"]["p99"] and d["request_goodput"] == pytest.approx(0.5)
    assert d["errors"] == ["", "", "", "boom"] and len(d["itls"]) == 4
    json.dumps(d)  # serialisable as is


def test_goodput_flags_parse_like_vllm():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1000,ttft:2"]) == {"e2el": 1000.0, "ttft": 2.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


# ------------------------------------------------------------------ arrivals and lengths

def test_arrivals_poisson_and_gamma():
    assert arrival_intervals(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = arrival_intervals(20000, 10.0, 1.0, seed=1)
    assert poisson == arrival_intervals(20000, 10.0, 1.0, seed=1)  # reproducible from the seed
    assert statistics.fmean(poisson) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = arrival_intervals(20000, 10.0, 0.25, seed=1)
    assert statistics.fmean(bursty) == pytest.approx(0.1, rel=0.05)  # same rate
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.08)  # gamma(k): CV 1/sqrt(k)
    with pytest.raises(ValueError):
        arrival_intervals(3, 0.0, 1.0, 0)


def test_length_range():
    assert length_range(128, 0.0) == (128, 128)
    assert length_range(100, 0.5) == (50, 150)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


# ------------------------------------------------------------------ workloads

def test_random_prompts_have_exact_lengths_and_round_trip(tokenizer):
    reqs = build_requests("random", tokenizer, 6, 64, 16, 0.0, seed=3)
    assert [r.prompt_len for r in reqs] == [64] * 6 and [r.output_len for r in reqs] == [16] * 6
    for r in reqs:
        assert r.token_ids == tokenizer.encode(r.prompt, add_special_tokens=False)  # text and id backends see one prompt
        assert r.messages is None
    assert len({tuple(r.token_ids) for r in reqs}) == 6
    again = build_requests("random", tokenizer, 6, 64, 16, 0.0, seed=3)
    assert [r.token_ids for r in again] == [r.token_ids for r in reqs]
    ragged = build_requests("random", tokenizer, 40, 40, 20, 0.5, seed=4)
    assert all(20 <= r.prompt_len <= 60 and 10 <= r.output_len <= 30 for r in ragged)
    assert len({r.prompt_len for r in ragged}) > 5


def test_shipped_prompt_set_is_sharegpt_and_package_data():
    path = shipped_prompts_path()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 50
    for row in rows:
        roles = [t["from"] for t in row["conversations"]]
        assert roles[:2] == ["human", "gpt"] and all(t["value"].strip() for t in row["conversations"])
    assert len({r["conversations"][0]["value"] for r in rows}) == len(rows)
    # pyproject's package data must name it, or a wheel would ship without it
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["pdserve.data"]
    assert any(fnmatch(str(path.relative_to(ROOT / "pdserve" / "data")), g) for g in globs)


def test_jsonl_requests_chat_template_reply_lengths_and_formats(tokenizer, tmp_path):
    reqs = build_requests("jsonl", tokenizer, 60, 0, None, 0.0, seed=0)  # more than the file holds: repeats
    assert len(reqs) == 60
    for r in reqs:
        assert r.messages[0]["role"] == "user" and r.prompt.startswith("<|im_start|>")
        assert r.token_ids[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
        assert r.prompt_len == len(r.token_ids) and r.output_len >= 4
    fixed = build_requests("jsonl", tokenizer, 3, 0, 7, 0.0, seed=0)
    assert [r.output_len for r in fixed] == [7, 7, 7]
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]},
        {"prompt": "plain"},
        {"conversations": [{"from": "gpt", "value": "no question"}]},
    ]))
    assert read_jsonl(f) == [("hello", "hi there"), ("plain", None)]
    reqs = build_requests("jsonl", tokenizer, 2, 0, None, 0.0, seed=0, path=str(f))
    assert sorted(r.output_len for r in reqs) == [4, 128]  # "hi there" is under 4 tokens; no reply: 128


# ------------------------------------------------------------------ OpenAI stream parsing

def sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def run_openai(handler, chat=False, tokenizer=None, req=None):
    import httpx

    async def go():
        b = OpenAIBackend("http://test", "/v1/chat/completions" if chat else "/v1/completions", "m", Sampling(ignore_eos=True), 10.0, chat,
                          tokenizer=tokenizer, transport=httpx.MockTransport(handler))
        async with b:
            return await b.request(req or BenchRequest("hi", 3, 5))

    return asyncio.run(go())


def test_openai_stream_counts_usage_and_skips_empty_chunks():
    import httpx

    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        body = sse({"choices": [{"text": "a", "finish_reason": None}]}, {"choices": [{"text": "b", "finish_reason": None}]},
                   {"choices": [{"text": "c", "finish_reason": None}]}, {"choices": [{"text": "", "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}, b"[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    out = run_openai(handler)
    assert out.success and out.generated_text == "abc" and out.output_tokens == 5
    assert len(out.itl) == 2 and out.ttft <= out.latency  # three text chunks; the bare terminator is not a token
    assert seen["stream"] and seen["stream_options"] == {"include_usage": True}
    assert seen["ignore_eos"] and seen["min_tokens"] == 5 and seen["max_tokens"] == 5 and seen["prompt"] == "hi"


def test_openai_chat_without_usage_counts_with_the_tokenizer(tokenizer):
    import httpx

    def handler(request):
        assert json.loads(request.content)["messages"] == [{"role": "user", "content": "hi"}]
        body = sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": " hello"}}]},
                   {"choices": [{"delta": {"content": " world"}}]}, b"[DONE]")
        return httpx.Response(200, content=body)

    out = run_openai(handler, chat=True, tokenizer=tokenizer)
    assert out.success and out.generated_text == " hello world"
    assert out.output_tokens == len(tokenizer.encode(" hello world", add_special_tokens=False))
    assert len(out.itl) == 1  # the role-only header is not the first token


def test_openai_errors_are_recorded_not_raised():
    import httpx

    out = run_openai(lambda request: httpx.Response(400, json={"error": {"message": "bad max_tokens"}}))
    assert not out.success and "HTTP 400" in out.error and "bad max_tokens" in out.error
    out = run_openai(lambda request: httpx.Response(200, content=sse({"error": {"message": "overloaded"}})))
    assert not out.success and "overloaded" in out.error
