"""Structured outputs through the HTTP gateway of launched services (real processes on loopback).

With a tiny random model (disaggregated, 1 prefill + 1 decode): vLLM's extra-body
`structured_outputs` (regex, choice, json) and older `guided_*` names, on both endpoints, greedy
and sampled, streamed and not, obey their constraint: the prefill worker's first token obeys the
grammar and the decode worker continues from the same state. An invalid schema or regex, or two
constraints at once, is a 400 naming the problem. An unconstrained request's greedy tokens are
the same whether or not constrained requests run beside it. In the gateway process, the check
has a time budget (a spec past it is a 400 limit_exceeded, and so is its repeat, without a second
compile) and a cache (a repeated spec is checked once).

With the default model (slow): the official openai client's `chat.completions.parse(...,
response_format=PydanticModel)` returns objects that validate for five schemas (nested objects,
enums, arrays, bounded numbers, required fields), greedy and sampled, streamed and not, on a
colocated worker and on a (prefill, decode) pair."""
import asyncio
import enum
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
import openai
import pydantic
import pytest

from tests.gateway.helpers import start_gateway_cluster
from tests.helpers import free_port, save_tiny_served_model, start_cluster

CHAT = [{"role": "user", "content": "Answer in the required format."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    # --no-slo: each worker's first constrained step loads xgrammar and the tokenizer (seconds), which
    # SLO control would take for the worker's speed and shed the next requests for a while
    launcher = start_gateway_cluster(d, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "16"], coordinator_args=["--no-slo"])
    yield launcher.plan.http_url, d.name
    launcher.stop()


def chat(url, model, **body):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 40, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]


def chat_stream(url, model, **body):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        extra = {k: body.pop(k) for k in list(body) if k in ("structured_outputs", "guided_choice", "guided_regex", "guided_json")}
        stream = c.chat.completions.create(model=model, messages=CHAT, max_tokens=40, stream=True, extra_body=extra, **body)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "sampled"])
def test_regex_and_choice_obey_their_constraint(tiny, sampling):
    url, model = tiny
    pattern = r"[0-9]{3}-[a-z]{2}"
    text, reason = chat(url, model, structured_outputs={"regex": pattern}, **sampling)
    assert re.fullmatch(pattern, text) and reason == "stop", text
    assert re.fullmatch(pattern, chat_stream(url, model, structured_outputs={"regex": pattern}, **sampling))
    colors = ["red", "green", "blue violet"]
    text, reason = chat(url, model, structured_outputs={"choice": colors}, **sampling)
    assert text in colors and reason == "stop"
    assert chat_stream(url, model, guided_choice=colors, **sampling) in colors
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"model": model, "prompt": "The code is", "max_tokens": 20,
                                                                 "structured_outputs": {"regex": pattern}, **sampling})
    assert r.status_code == 200 and re.fullmatch(pattern, r.json()["choices"][0]["text"]), r.text


def test_json_schema_with_bounded_fields(tiny):
    url, model = tiny
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "ok", "n"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    # compact JSON (vLLM's disable_any_whitespace): by default the grammar lets the model choose its whitespace, and a
    # random model spends its tokens on it (test_any_whitespace_by_default checks the grammars themselves)
    compact = {"disable_any_whitespace": True}
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        text, reason = chat(url, model, response_format=rf, structured_outputs=compact, **sampling)
        doc = json.loads(text)
        assert reason == "stop" and doc["color"] in ("red", "blue") and isinstance(doc["ok"], bool) and 1 <= doc["n"] <= 9
        assert text == json.dumps(doc)  # xgrammar's compact form: ", " and ": ", no other whitespace
        doc = json.loads(chat_stream(url, model, structured_outputs={"json": schema, **compact}, **sampling))
        assert set(doc) == {"color", "ok", "n"}


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 'Unsupported type "objectx"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}}, "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs"),
    ({"response_format": {"type": "yaml"}}, "response_format type must be"),
    ({"structured_outputs": {"regex": "[a-"}}, "invalid regex"),
    ({"structured_outputs": {"choice": []}}, "choice must be a non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "grammar not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "give one structured output constraint"),
])
def test_invalid_constraints_are_400s_naming_the_problem(tiny, body, needle):
    url, model = tiny
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_free_requests_are_unchanged_beside_constrained_ones(tiny):
    url, model = tiny
    free = {"model": model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{url}/v1/completions", json=free, timeout=120).json()["choices"][0]["text"]

    async def together():
        async with httpx.AsyncClient(timeout=120) as c:
            constrained = [c.post(f"{url}/v1/completions", json={**free, "ignore_eos": False, "prompt": f"Code {i}:",
                                                                 "structured_outputs": {"regex": r"[a-z]{5,30}"}}) for i in range(4)]
            rs = await asyncio.gather(c.post(f"{url}/v1/completions", json=free), *constrained)
        return [r.json()["choices"][0]["text"] for r in rs]

    beside, *codes = asyncio.run(together())
    assert beside == alone
    assert all(re.fullmatch(r"[a-z]{5,30}", t) for t in codes), codes


# ------------------------------------------------------------------ the default model, the openai SDK's parse()

class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):  # nested objects
    name: str = pydantic.Field(max_length=24)
    address: Address


class Condition(str, enum.Enum):
    sunny = "sunny"
    rainy = "rainy"
    cloudy = "cloudy"


class Weather(pydantic.BaseModel):  # enums
    condition: Condition
    windy: bool


class Shopping(pydantic.BaseModel):  # arrays
    items: list[Annotated[str, pydantic.StringConstraints(max_length=20)]] = pydantic.Field(min_length=1, max_length=3)


class Reading(pydantic.BaseModel):  # numbers with bounds
    temperature_c: float = pydantic.Field(ge=-50, le=60)
    humidity: int = pydantic.Field(ge=0, le=100)


class Book(pydantic.BaseModel):  # required fields (and an optional one)
    title: str = pydantic.Field(max_length=40)
    author: str = pydantic.Field(max_length=40)
    year: int = pydantic.Field(ge=1000, le=2100)
    isbn: str | None = pydantic.Field(default=None, max_length=20)


SCHEMAS = [(Person, "Describe a person who lives in Paris."), (Weather, "What is the weather like today?"),
           (Shopping, "List what to buy for a cake."), (Reading, "Report the temperature and humidity."),
           (Book, "Name a famous novel.")]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def default_service(request, tmp_path_factory):
    from pdserve.common.model_path import resolve_model_path

    counts = dict(prefill=0, decode=0, colocated=1) if request.param == "colocated" else dict(prefill=1, decode=1)
    launcher = start_cluster(resolve_model_path(None), tmp_path_factory.mktemp("logs"), gateway=True, http_port=free_port(),
                             engine_args=["--kv-cache-mb", "64"], coordinator_args=["--no-slo"], timeout=300, **counts)
    yield launcher.plan.http_url
    launcher.stop()


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
@pytest.mark.slow
def test_openai_parse_validates_for_five_schemas(default_service):
    with openai.OpenAI(base_url=f"{default_service}/v1", api_key="x", max_retries=0, timeout=300) as c:
        model = c.models.list().data[0].id

        def parse_and_stream(i, kind, question):
            messages = [{"role": "user", "content": question}]
            sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.7, seed=i)
            done = c.chat.completions.parse(model=model, messages=messages, response_format=kind, max_tokens=160, **sampling)
            msg = done.choices[0].message
            assert isinstance(msg.parsed, kind), msg.content
            kind.model_validate_json(msg.content)
            other = dict(temperature=0.7, seed=i) if i % 2 == 0 else dict(temperature=0)
            with c.chat.completions.stream(model=model, messages=messages, response_format=kind, max_tokens=160, **other) as stream:
                final = stream.get_final_completion()
            assert isinstance(final.choices[0].message.parsed, kind), final.choices[0].message.content

        with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # the five schemas decode in one batch, each with its own grammar
            for job in [pool.submit(parse_and_stream, i, kind, question) for i, (kind, question) in enumerate(SCHEMAS)]:
                job.result()


def _spec_jobs(spec):
    import types

    return [types.SimpleNamespace(sampling={"structured": spec})]


def test_the_gateway_check_has_a_budget_and_a_cache(monkeypatch):
    from pdserve.gateway import structured as gs
    from pdserve.gateway.errors import ApiError
    from pdserve_client.params import StructuredOutput

    monkeypatch.setattr(gs, "_LANE", None)  # a fresh lane: its own cache and budget
    lane = gs._lane()
    compiled = []
    check = lane.compile
    monkeypatch.setattr(lane, "compile", lambda spec: compiled.append(spec) or check(spec))
    ok = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}")
    for _ in range(3):
        asyncio.run(gs.check_jobs(_spec_jobs(ok)))
    assert compiled == [ok]  # checked once, then answered from the cache

    item = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{1,8}"}, "b": {"type": "integer"}}}
    big = StructuredOutput("json", json.dumps({"type": "object", "properties": {f"f{i}": item for i in range(300)}}))
    monkeypatch.setattr(lane, "budget_ms", 1)
    for _ in range(2):
        with pytest.raises(ApiError) as refused:
            asyncio.run(gs.check_jobs(_spec_jobs(big)))
        assert refused.value.status == 400 and refused.value.code == "limit_exceeded", refused.value.body()
        assert refused.value.param == "response_format" and "1 ms" in refused.value.message, refused.value.message
    deadline = time.monotonic() + 30
    while lane.jobs:  # the abandoned check runs on in its thread
        assert time.monotonic() < deadline, lane.jobs
        time.sleep(0.005)
    with pytest.raises(ApiError) as again:
        asyncio.run(gs.check_jobs(_spec_jobs(big)))
    assert again.value.code == "limit_exceeded" and compiled.count(big) == 1  # remembered, not compiled again


def test_an_unconstrained_request_imports_no_grammar_machinery():
    """The gateway checks specs with runtime.structured (xgrammar, torch: seconds to import on a
    small CPU); a request without one must not pay that (it did: the first plain request after
    start took ~1.7 s of the gateway's CPU)."""
    import subprocess
    import sys

    code = ("import asyncio, sys, types; from pdserve.gateway.structured import check_jobs; "
            "asyncio.run(check_jobs([types.SimpleNamespace(sampling={'structured': None}), types.SimpleNamespace(sampling={})])); "
            "print('torch' in sys.modules, 'xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_the_gateway_refuses_a_counted_repetition_past_the_limit_before_any_worker():
    """Issue 38: `.{0,100000}` made every token's mask of a decode worker slow (15-25 ms, up to 1.25 s)."""
    from pdserve.gateway import structured as gs
    from pdserve.gateway.errors import ApiError
    from pdserve_client.params import StructuredOutput

    for spec, param in [(StructuredOutput("regex", ".{0,100000}"), "structured_outputs"),
                        (StructuredOutput("json", json.dumps({"type": "string", "pattern": "[a-z]{300}"})), "response_format")]:
        with pytest.raises(ApiError) as refused:
            asyncio.run(gs.check_jobs(_spec_jobs(spec)))
        assert refused.value.status == 400 and refused.value.code == "limit_exceeded" and refused.value.param == param
        assert "the limit is 128" in refused.value.message, refused.value.message
