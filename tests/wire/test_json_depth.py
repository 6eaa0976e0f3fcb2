"""Nesting depth as a bound (issue 38): `nests_deeper` agrees with a recursive count on random JSON
(strings full of brackets and escapes included) and is quick on 8 MB of brackets; deep_field names
the top-level field that nests; a body nested past the decoder's recursion is a 400
limit_exceeded (inline and as the parse lane's child prepares it), as is a structured-output
schema or a tool past max_json_depth, at the gateway and at the coordinator's check alike."""
import json
import random
import time

import pytest

from pdserve.gateway.errors import ApiError
from pdserve.gateway.parse_lane import prepare
from pdserve.gateway.schema import ChatCompletionRequest, chat_jobs, deep_field, request_bounds, structured_bounds
from pdserve.wire.limits import FieldLimitExceeded, RequestLimits, nests_deeper
from pdserve_client.params import StructuredOutput

L = RequestLimits()


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def random_json(rng: random.Random, levels: int):
    if levels == 0:
        return rng.choice([1, 'a"[{\\', "]}", None, {}, []])
    if rng.random() < 0.5:
        return [random_json(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    return {f'k{i}"]': random_json(rng, levels - 1) for i in range(rng.randint(0, 3))}


def nested_schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def test_nests_deeper_agrees_with_a_recursive_count():
    rng = random.Random(38)
    for _ in range(2000):
        value = random_json(rng, rng.randint(0, 12))
        text, d = json.dumps(value), depth(value)
        for limit in range(14):
            assert nests_deeper(text, limit) == (d > limit), (text, limit, d)


def test_nests_deeper_is_quick_on_megabytes_of_brackets():
    for text in (b"[" * 4_000_000 + b"]" * 4_000_000, (b"[" * 63 + b"]" * 63) * 60_000, json.dumps({"a": ["x" * 1000] * 8000}).encode()):
        t0 = time.perf_counter()
        nests_deeper(text, L.max_json_depth)
        assert time.perf_counter() - t0 < 2.0


def test_deep_field_names_the_field_that_nests():
    body = b'{"model":"m","messages":[{"role":"user","content":"[[[[["}],"response_format":' + b"[" * 500 + b"]" * 500 + b"}"
    assert deep_field(body, 64) == "response_format"
    assert deep_field(b"[" * 1000, 64) is None  # not an object
    assert deep_field(b'{"a":[[1]],"b":2}', 64) is None


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize("body, param", [
    (b'{"model":"m","messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":%s}}}'
     % nested_schema(3000).encode(), "response_format"),
    (b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "messages"),
    (b'{"model":"m","messages":[],"junk":' + b"{\"a\":" * 5000 + b"1" + b"}" * 5000 + b"}", "junk"),
])
def test_a_body_nested_past_the_decoder_is_a_400_naming_the_field(body, param):
    for kind in ("ChatCompletionRequest", "tokenize"):
        with pytest.raises(ApiError) as e:
            prepare(body, kind, L)
        assert (e.value.status, e.value.code, e.value.param) == (400, "limit_exceeded", param)


def test_schemas_and_tools_past_max_json_depth_are_refused_and_within_it_pass():
    past, within = L.max_json_depth // 2 + 1, L.max_json_depth // 2 - 1  # 2 JSON levels a schema level, 1 innermost
    for levels, param in ((400, "response_format"), (past, "response_format")):
        body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(nested_schema(levels))}})
        with pytest.raises(ApiError) as e:
            req = prepare(body, "ChatCompletionRequest", L)
            structured_bounds(chat_jobs(req, 16), L)
        assert (e.value.code, e.value.param) == ("limit_exceeded", param)
    for schema in (nested_schema(600), nested_schema(past)):  # as a string: json.loads recurses; past the bound
        with pytest.raises(ApiError) as e:
            structured_bounds(chat_jobs(prepare(chat(guided_json=schema), "ChatCompletionRequest", L), 16), L)
        assert (e.value.code, e.value.param) == ("limit_exceeded", "response_format" if schema == nested_schema(past) else "guided_json")
    tool = {"type": "function", "function": {"name": "f", "parameters": json.loads(nested_schema(past))}}
    with pytest.raises(ApiError) as e:
        prepare(chat(tools=[tool]), "ChatCompletionRequest", L)
    assert (e.value.code, e.value.param) == ("limit_exceeded", "tools")
    ok = prepare(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(nested_schema(within))}},
                      tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(nested_schema(within))}}]),
                 "ChatCompletionRequest", L)
    assert isinstance(ok, ChatCompletionRequest)
    request_bounds(ok, L)
    structured_bounds(chat_jobs(ok, 16), L)


def test_the_coordinators_check_bounds_a_schemas_nesting():
    L.check_structured(StructuredOutput("json", nested_schema(L.max_json_depth // 2 - 1)))
    with pytest.raises(FieldLimitExceeded) as e:
        L.check_structured(StructuredOutput("json", nested_schema(L.max_json_depth // 2 + 1)))
    assert e.value.param == "structured"
