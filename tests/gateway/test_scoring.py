"""Scoring through the HTTP gateway of a launched service (real processes on loopback), once on a
(prefill, decode) pair, where the prompt's logprobs are computed on the prefill worker and travel
with the hand-off, and once on a colocated worker: `echo` with `logprobs` as lm-evaluation-harness's
local-completions back-end calls it (token ids, max_tokens 1 or 0, logprobs 1), vLLM's
`prompt_logprobs`, and echo streamed. The prompt's logprobs equal a teacher-forced pass of the same
checkpoint in transformers (float32, within ATOL), a prompt longer than the scoring chunk included;
every KV block is free at the end."""
import json

import httpx
import openai
import pytest
import torch

from pdserve.common.tokenizer import load_tokenizer
from pdserve.runtime.scoring import SCORE_CHUNK
from pdserve_client.library import Client
from tests.helpers import wait_all_blocks_free

ATOL = 1e-4  # float32 fast path against transformers' float32 forward (seen: ~1e-5)


@pytest.fixture(scope="module")
def model_dir(served_1024):
    return served_1024


@pytest.fixture
def service(kind_service):
    """tests/gateway/conftest.py's service (a pair, then a colocated worker), shared with test_responses.py."""
    return kind_service


@pytest.fixture(scope="module")
def reference(model_dir):
    """Teacher-forced log-softmax rows of the same checkpoint in transformers: row i scores token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(str(model_dir))


def ids_of(tok, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, len(tok), (n,), generator=g).tolist()


def complete(service, **body) -> dict:
    r = httpx.post(f"{service.plan.http_url}/v1/completions", json={"model": model_name(service), **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def model_name(service) -> str:
    return httpx.get(f"{service.plan.http_url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("n", [9, SCORE_CHUNK + 44])  # the longer prompt is scored in two chunks
def test_echo_logprobs_as_lm_eval_asks_equal_teacher_forcing(service, reference, tok, n):
    ids = ids_of(tok, n, seed=n)
    ref = reference(ids)
    with openai.OpenAI(base_url=f"{service.plan.http_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        out = c.completions.create(model=model_name(service), prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0, seed=1234)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(ref[i, ids[i + 1]]) for i in range(n - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:n], expected)) < ATOL
    # lm-eval's parse_logprobs: the continuation's sum and whether each token was the greedy one
    ctxlen = n // 2
    assert abs(sum(lp.token_logprobs[ctxlen:-1]) - sum(expected[ctxlen - 1:])) < ATOL * n
    greedy = [tok_lp == max(top.values()) for tok_lp, top in zip(lp.token_logprobs[1:n], lp.top_logprobs[1:n])]
    assert greedy == [int(ref[i].argmax()) == ids[i + 1] for i in range(n - 1)]
    assert lp.token_logprobs[n] == pytest.approx(float(ref[n - 1].max()), abs=ATOL)  # the greedy token sampled after the prompt
    assert choice.text.startswith(tok.decode(ids)) and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 1


def test_echo_with_max_tokens_zero_scores_the_prompt_only(service, reference, tok):
    ids = ids_of(tok, 12, seed=3)
    body = complete(service, prompt=ids, echo=True, max_tokens=0, logprobs=2, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == 12 and body["usage"]["completion_tokens"] == 0
    ref = reference(ids)
    for i, top in enumerate(choice["logprobs"]["top_logprobs"][1:]):
        want = ref[i].topk(2)
        assert len(top) in (2, 3)  # the top 2 and the prompt token itself
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(want.values.tolist(), abs=ATOL)
    r = httpx.post(f"{service.plan.http_url}/v1/completions", json={"model": model_name(service), "prompt": ids, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # without echo there is nothing to return


def test_vllm_prompt_logprobs_field(service, reference, tok):
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt, add_special_tokens=True)
    choice = complete(service, prompt=prompt, max_tokens=2, prompt_logprobs=3, temperature=0)["choices"][0]
    field = choice["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    ref = reference(ids)
    for i, entry in enumerate(field[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(float(ref[i, ids[i + 1]]), abs=ATOL)
        assert own["rank"] == 1 + int((ref[i] > ref[i, ids[i + 1]]).sum()) and own["decoded_token"] == tok.decode([ids[i + 1]])
        top = ref[i].topk(3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=ATOL) and entry[str(t)]["rank"] == rank
    assert choice["logprobs"] is None  # not asked


def test_echo_streamed_equals_echo_whole(service, tok):
    ids = ids_of(tok, 20, seed=5)
    whole = complete(service, prompt=ids, echo=True, max_tokens=4, logprobs=1, temperature=0, ignore_eos=True)["choices"][0]
    with openai.OpenAI(base_url=f"{service.plan.http_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        chunks = list(c.completions.create(model=model_name(service), prompt=ids, echo=True, max_tokens=4, logprobs=1, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert text == whole["text"] and text.startswith(tok.decode(ids))
    assert streamed == whole["logprobs"]["token_logprobs"] and len(streamed) == 24
    plain = complete(service, prompt="Hello there", echo=True, max_tokens=3, temperature=0)["choices"][0]
    assert plain["text"].startswith("Hello there") and plain["logprobs"] is None


def scored(service) -> tuple[int, int]:
    """(prompts scored, their tokens) so far: the coordinator's counts (each scored token is computed)."""
    with Client(service.plan.client_addr, timeout=30) as c:
        counts = c.stats()["requests"]
    return counts.get("scored_prompts", 0), counts.get("scored_prompt_tokens", 0)


def test_n_choices_share_one_scoring_pass_per_distinct_prompt(service, reference, tok):
    """Issue 38's amplification scaled to this model: prompts of token ids, n choices, echo and
    prompt_logprobs. Each distinct prompt is scored once (a prompt given twice too), and every
    choice of it carries the same scores, equal to teacher forcing."""
    a, b = ids_of(tok, 300, seed=7), ids_of(tok, 200, seed=8)
    n = 8
    before = scored(service)
    body = complete(service, prompt=[a, b, a], n=n, echo=True, max_tokens=0, logprobs=1, prompt_logprobs=1, temperature=0)
    after = scored(service)
    assert (after[0] - before[0], after[1] - before[1]) == (2, len(a) + len(b))  # before the fix: (24, 8 * 800), each choice scored alone
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 3 * n
    for p, ids in enumerate((a, b, a)):
        mine = choices[p * n:(p + 1) * n]
        assert all(c["prompt_logprobs"] == choices[p * n]["prompt_logprobs"] for c in mine)
        assert all(c["logprobs"] == choices[p * n]["logprobs"] for c in mine) and all(c["text"] == tok.decode(ids) for c in mine)
        ref = reference(ids)
        field = choices[p * n]["prompt_logprobs"]
        assert len(field) == len(ids) and max(abs(field[i + 1][str(ids[i + 1])]["logprob"] - float(ref[i, ids[i + 1]]))
                                              for i in range(len(ids) - 1)) < ATOL
    assert choices[0]["prompt_logprobs"] == choices[2 * n]["prompt_logprobs"]
    assert body["usage"]["prompt_tokens"] == 2 * len(a) + len(b)


def test_shared_scores_stream_with_each_choice(service, tok):
    ids = ids_of(tok, 40, seed=9)
    before = scored(service)
    body = {"model": model_name(service), "prompt": ids, "n": 4, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    firsts = {}
    with httpx.stream("POST", f"{service.plan.http_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                    firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1, 2, 3] and scored(service)[1] - before[1] == len(ids)
    assert all(c["prompt_logprobs"] == firsts[0]["prompt_logprobs"] and len(c["prompt_logprobs"]) == len(ids) for c in firsts.values())


def test_prefill_work_of_one_request_is_bounded(service):
    """max_request_prefill_tokens (wire/limits.py): prompts x their lengths, whatever n; one id
    over is a 400 naming the prompt, before anything is tokenized or run."""
    from pdserve.wire.limits import RequestLimits

    limit, per = RequestLimits().max_request_prefill_tokens, RequestLimits().max_token_ids
    prompts = [[1] * per] * (limit // per) + [[1]]
    body = json.dumps({"model": model_name(service), "prompt": prompts, "echo": True, "max_tokens": 0, "prompt_logprobs": 1},
                      separators=(",", ":"))
    before = scored(service)
    r = httpx.post(f"{service.plan.http_url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("limit_exceeded", "prompt") and "--max-request-prefill-tokens" in err["message"]
    assert scored(service) == before


def test_every_request_ran_on_the_path_of_the_launch_and_freed_its_blocks(service):
    with Client(service.plan.client_addr, timeout=30) as c:
        stats = wait_all_blocks_free(c, timeout=10)
    counts = stats["requests"]
    if service.kind == "disaggregated":  # every prompt was scored on the prefill worker and handed off
        assert counts.get("path:remote") == counts["requests"] == stats["kv_transfer"]["handoffs"]
    assert counts.get("invalid_worker_messages", 0) == 0 and counts["requests"] >= 1
