"""The table of bounds (wire/limits.py) without processes: each bound accepts a request at its
limit and refuses one past it as limit_exceeded naming the field, at the gateway (a body's
fields, gateway/schema.py) and on the coordinator's client port (a GenerateRequest, by its frame's
lengths before it is decoded and field by field after, by a coordinator built in-process)."""
import json

import pytest

from pdserve.common.errors import LimitExceededError
from pdserve.coordinator.server import Coordinator, CoordinatorConfig
from pdserve.gateway.schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_jobs,
    decode_body,
    refuse_oversized,
    request_bounds,
    structured_bounds,
)
from pdserve.wire.limits import FieldLimitExceeded, RequestLimits
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import ChatMessage, GenerateRequest, encode

L = RequestLimits()


def chat(messages=({"role": "user", "content": "hi"},), **fields) -> ChatCompletionRequest:
    return decode_body(json.dumps({"model": "m", "messages": list(messages), **fields}).encode(), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return decode_body(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(), CompletionRequest)


def refused(req, param, trace=None, limits=L):
    with pytest.raises(ApiError) as e:
        request_bounds(req, limits, trace)
    assert (e.value.status, e.value.code, e.value.param) == (400, "limit_exceeded", param), e.value.message


def msgs(n, content=""):
    return [{"role": "user", "content": content}] * n


# ------------------------------------------------------------------ gateway: each bound at its limit, and one past it

@pytest.mark.parametrize("at, over, param", [
    (lambda: chat(msgs(L.max_messages)), lambda: chat(msgs(L.max_messages + 1)), "messages"),
    (lambda: chat([{"role": "user", "content": [{"type": "text", "text": "a"}] * L.max_content_parts}]),
     lambda: chat([{"role": "user", "content": [{"type": "text", "text": "a"}] * (L.max_content_parts + 1)}]), "messages"),
    (lambda: chat([{"role": "user", "content": "x", "name": "n" * L.max_name_length}]),
     lambda: chat([{"role": "user", "content": "x", "name": "n" * (L.max_name_length + 1)}]), "name"),
    (lambda: completion(model="m" * L.max_name_length), lambda: completion(model="m" * (L.max_name_length + 1)), "model"),
    (lambda: completion(user="u" * L.max_name_length), lambda: completion(user="u" * (L.max_name_length + 1)), "user"),
    (lambda: completion(n=L.max_n), lambda: completion(n=L.max_n + 1), "n"),
    (lambda: completion(prompt=["a"] * 8, n=L.max_fanout // 8), lambda: completion(prompt=["a"] * 8, n=L.max_fanout // 8 + 1), "n"),
    (lambda: completion(prompt=["a"] * L.max_prompts), lambda: completion(prompt=["a"] * (L.max_prompts + 1)), "prompt"),
    (lambda: completion(prompt=[1] * L.max_token_ids), lambda: completion(prompt=[1] * (L.max_token_ids + 1)), "prompt"),
    (lambda: completion(prompt=[[1] * L.max_token_ids]), lambda: completion(prompt=[[1], [1] * (L.max_token_ids + 1)]), "prompt"),
    (lambda: completion(prompt="x" * L.max_prompt_bytes), lambda: completion(prompt="x" * (L.max_prompt_bytes + 1)), "prompt"),
    (lambda: completion(prompt=[[1] * (L.max_request_prefill_tokens // 8)] * 8),
     lambda: completion(prompt=[[1] * (L.max_request_prefill_tokens // 8)] * 8 + [[1]]), "prompt"),
    (lambda: completion(prompt=["x" * (L.max_request_prefill_tokens // 2)] * 2),
     lambda: completion(prompt=["x" * (L.max_request_prefill_tokens // 2)] * 2 + ["x"]), "prompt"),
    (lambda: completion(logprobs=L.max_logprobs), lambda: completion(logprobs=L.max_logprobs + 1), "logprobs"),
    (lambda: completion(prompt_logprobs=L.max_logprobs), lambda: completion(prompt_logprobs=L.max_logprobs + 1), "prompt_logprobs"),
    (lambda: chat(logprobs=True, top_logprobs=L.max_logprobs), lambda: chat(logprobs=True, top_logprobs=L.max_logprobs + 1), "top_logprobs"),
    (lambda: completion(max_tokens=L.max_tokens), lambda: completion(max_tokens=L.max_tokens + 1), "max_tokens"),
    (lambda: chat(max_completion_tokens=L.max_tokens), lambda: chat(max_completion_tokens=L.max_tokens + 1), "max_completion_tokens"),
    (lambda: completion(stop=["s"] * L.max_stop), lambda: completion(stop=["s"] * (L.max_stop + 1)), "stop"),
    (lambda: completion(stop_token_ids=[1] * L.max_stop_token_ids), lambda: completion(stop_token_ids=[1] * (L.max_stop_token_ids + 1)),
     "stop_token_ids"),
])
def test_each_body_bound_at_its_limit_and_one_past(at, over, param):
    request_bounds(at(), L)
    refused(over(), param)


def test_prefill_bound_counts_prompts_not_their_choices():
    """n choices of a prompt share its prefill (one scoring pass, then the prefix cache): issue 38's
    request, 8 prompts of 8k ids with n 128, is within the prefill bound (the answer's bound is
    below); its prompts made longer are not."""
    limits = RequestLimits(max_request_prefill_tokens=65536, max_scored_entries=2**30)
    request_bounds(completion(prompt=[[1] * 8192] * 8, n=128, echo=True, max_tokens=0, prompt_logprobs=1), limits)
    refused(completion(prompt=[[1] * 8193] * 8, n=1, echo=True, max_tokens=0, prompt_logprobs=1), "prompt", limits=limits)
    assert "--max-request-prefill-tokens" in limits_message(completion(prompt=[[1] * 65537]), limits)


def test_the_scores_an_answer_repeats_are_bounded_over_every_choice_and_alternative():
    """Each choice's answer carries its prompt's scores: prompt tokens x n x (1 + k), for echo's
    logprobs and for prompt_logprobs. Issue 38's request (16.8M of them) is refused naming the field."""
    issue_38 = dict(prompt=[[1] * 8192] * 8, n=128, echo=True, max_tokens=0, prompt_logprobs=1)
    refused(completion(**issue_38), "prompt_logprobs")
    at = dict(prompt=[[1] * 1024] * 8, n=128, echo=True, max_tokens=0)  # 2**20 prompt tokens over the choices
    request_bounds(completion(**at, prompt_logprobs=1), L)  # x 2: at the bound
    refused(completion(**at, prompt_logprobs=1, logprobs=0), "prompt_logprobs")  # echo's logprobs too: x 3
    refused(completion(**at, logprobs=2), "logprobs")
    request_bounds(completion(**{**at, "echo": False}, logprobs=5), L)  # the prompt is not scored: nothing repeats
    assert L.max_scored_entries == 2**21


def limits_message(req, limits) -> str:
    with pytest.raises(ApiError) as e:
        request_bounds(req, limits)
    return e.value.message


def tool(name="f", description=None):
    fn = {"name": name, "parameters": {"type": "object"}}
    return {"type": "function", "function": fn if description is None else {**fn, "description": description}}


def call(name="f", id_="c"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": "{}"}}


def _tool_sized(n: int) -> dict:
    """A tool whose JSON (as the bound counts it: the decoded Struct re-encoded) has exactly n bytes."""
    import msgspec

    from pdserve.gateway.tools import Tool

    base = len(msgspec.json.encode(msgspec.convert(tool(description=""), Tool)))
    return tool(description="d" * (n - base))


@pytest.mark.parametrize("at, over, param", [
    (lambda: chat(tools=[tool()] * L.max_tools), lambda: chat(tools=[tool()] * (L.max_tools + 1)), "tools"),
    (lambda: chat(tools=[tool("t" * L.max_tool_name_length)]), lambda: chat(tools=[tool("t" * (L.max_tool_name_length + 1))]), "tools"),
    (lambda: chat(tools=[_tool_sized(L.max_tool_bytes)]), lambda: chat(tools=[_tool_sized(L.max_tool_bytes + 1)]), "tools"),
    (lambda: chat([{"role": "assistant", "tool_calls": [call()] * L.max_tool_calls}]),
     lambda: chat([{"role": "assistant", "tool_calls": [call()] * (L.max_tool_calls + 1)}]), "messages"),
    (lambda: chat([{"role": "assistant", "tool_calls": [call(id_="i" * L.max_name_length)]}]),
     lambda: chat([{"role": "assistant", "tool_calls": [call(id_="i" * (L.max_name_length + 1))]}]), "messages"),
    (lambda: chat([{"role": "tool", "content": "r", "tool_call_id": "i" * L.max_name_length}]),
     lambda: chat([{"role": "tool", "content": "r", "tool_call_id": "i" * (L.max_name_length + 1)}]), "messages"),
    (lambda: chat(tools=[tool()], tool_choice={"type": "function", "function": {"name": "n" * L.max_name_length}}),
     lambda: chat(tools=[tool()], tool_choice={"type": "function", "function": {"name": "n" * (L.max_name_length + 1)}}), "tool_choice"),
])
def test_each_tool_bound_at_its_limit_and_one_past(at, over, param):
    request_bounds(at(), L)
    refused(over(), param)


def test_tools_and_tool_calls_count_in_the_prompt_bytes():
    limits = RequestLimits(max_prompt_bytes=4000)
    request_bounds(chat(tools=[_tool_sized(3000)]), limits)
    refused(chat(tools=[_tool_sized(3000)] * 2), "messages", limits=limits)
    args = json.dumps({"x": "y" * 3000})
    refused(chat([{"role": "assistant", "tool_calls": [{**call(), "function": {"name": "f", "arguments": args}}] * 2}]), "messages",
            limits=limits)




def test_message_overhead_counts_in_the_prompt_bytes():
    """Each message counts message_overhead bytes besides its text: 200,000 empty messages are
    not 0 bytes. At exactly max_prompt_bytes accepted, one byte more refused."""
    limits = RequestLimits(max_prompt_bytes=1000, message_overhead=32)
    n = 10
    text = 1000 - n * 32 - n * len("user")  # what is left for the contents
    at = [{"role": "user", "content": "x" * (text if i == 0 else 0)} for i in range(n)]
    request_bounds(chat(at), limits)
    at[0] = {"role": "user", "content": "x" * (text + 1)}
    refused(chat(at), "messages", limits=limits)
    refused(chat(msgs(1000 // 32 + 1)), "messages", limits=limits)  # empty messages alone
    assert limits.check_prompt_bytes(["ab", "c"], messages=2) == 3 + 64  # the cost a tokenizing lane is chosen by


def test_trace_headers_only_w3c_keys_of_bounded_length():
    request_bounds(completion(), L, {"traceparent": "t" * L.max_trace_header, "tracestate": "s" * L.max_trace_header})
    refused(completion(), "tracestate", {"tracestate": "s" * (L.max_trace_header + 1)})
    refused(completion(), "trace_headers", {"x-other": "1"})


def test_structured_specs_are_sized_before_they_are_compiled():
    limits = RequestLimits(max_structured_bytes=2000, max_regex_length=100, max_choices=4, max_choice_length=10)

    def schema_of(n):  # a JSON schema whose text (json.dumps) is exactly n bytes
        base = len(json.dumps({"type": "string", "description": ""}))
        return {"type": "string", "description": "d" * (n - base)}

    def spec_check(req):
        request_bounds(req, limits)
        structured_bounds(chat_jobs(req, 16), limits)

    ok = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema_of(2000)}})
    spec_check(ok)
    with pytest.raises(ApiError) as e:
        spec_check(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema_of(2001)}}))
    assert (e.value.code, e.value.param) == ("limit_exceeded", "response_format")
    # a 1.2 MB description is refused before the spec is even built from it
    refused(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema_of(1_200_000)}}),
            "response_format")
    for ok, bad in (({"regex": "a" * 100}, {"regex": "a" * 101}),
                    ({"choice": ["c" * 10] * 4}, {"choice": ["c" * 10] * 5}),
                    ({"choice": ["c" * 10]}, {"choice": ["c" * 11]})):
        spec_check(chat(structured_outputs=ok))
        with pytest.raises(ApiError) as e:
            spec_check(chat(structured_outputs=bad))
        assert (e.value.code, e.value.param) == ("limit_exceeded", "structured_outputs"), bad


@pytest.mark.parametrize("kwargs, ok", [
    ({"enable_thinking": False, "x": 1, "y": 0.5, "z": None, "s": "v" * 256}, True),
    ({f"k{i}": True for i in range(8)}, True),
    ({f"k{i}": True for i in range(9)}, False),
    ({"s": "v" * 257}, False),
    ({"chat_template": "PWNED{% for m in messages %}{{ m.content }}{% endfor %}"}, False),
    ({"tokenize": True}, False), ({"tools": None}, False), ({"documents": None}, False), ({"conversation": None}, False),
    ({"return_dict": True}, False), ({"return_assistant_tokens_mask": True}, False),
    ({"not an identifier": 1}, False), ({"nested": {"a": 1}}, False), ({"lst": [1]}, False),
])
def test_chat_template_kwargs_is_an_allow_list_of_plain_values(kwargs, ok):
    if ok:
        L.check_template_kwargs(kwargs)
    else:
        with pytest.raises(FieldLimitExceeded) as e:
            L.check_template_kwargs(kwargs)
        assert e.value.param == "chat_template_kwargs" and e.value.code == "limit_exceeded"


def test_a_big_body_is_refused_by_its_message_count_before_it_is_decoded():
    body = json.dumps({"model": "m", "n": 4, "messages": msgs(200_000)}).encode()
    with pytest.raises(ApiError) as e:
        refuse_oversized(body, L)
    assert (e.value.code, e.value.param) == ("limit_exceeded", "messages")
    refuse_oversized(json.dumps({"model": "m", "messages": msgs(L.max_messages)}).encode(), L)


# ------------------------------------------------------------------ coordinator: frames by their lengths, then fields

@pytest.fixture(scope="module")
def coordinator():
    from tests.helpers import free_port

    coord = Coordinator(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"), tokenizer=object())
    yield coord
    coord.release_sockets()


def gen(rid="r", params=None, **kw):
    if not any(k in kw for k in ("prompt", "messages", "token_ids")):
        kw["prompt"] = "hi"
    return GenerateRequest(rid, params or SamplingParams(), **kw)


@pytest.mark.parametrize("req, why", [
    (gen("i" * 2**20), "request_id"),
    (gen(messages=[ChatMessage("user", "")] * 200_000), "messages"),
    (gen(token_ids=[1] * (L.max_token_ids + 1)), "token_ids"),
    (gen(trace_headers={"traceparent": "t" * 70_000}), "trace_headers"),
    (gen(params=SamplingParams(structured=StructuredOutput("json", "{" + " " * 70_000 + "}"))), "structured"),
])
def test_oversized_frames_are_refused_by_their_lengths(req, why):
    rid, message = L.oversized_frame(encode(req))
    assert rid == req.request_id and message.startswith(why)


def test_frames_at_the_limits_are_left_to_the_decoder():
    for req in (gen("i" * L.max_name_length, prompt="x" * 70_000), gen(messages=[ChatMessage("user", "x" * 20)] * L.max_messages),
                gen(token_ids=[1] * L.max_token_ids)):
        assert L.oversized_frame(encode(req)) is None


@pytest.mark.parametrize("at, over", [
    (gen("i" * L.max_name_length), gen("i" * (L.max_name_length + 1))),
    (gen(trace_headers={"tracestate": "s" * L.max_trace_header}), gen(trace_headers={"tracestate": "s" * (L.max_trace_header + 1)})),
    (gen(messages=[ChatMessage("user", "")] * L.max_messages), gen(messages=[ChatMessage("user", "")] * (L.max_messages + 1))),
    (gen(token_ids=[1] * L.max_token_ids), gen(token_ids=[1] * (L.max_token_ids + 1))),
    (gen(params=SamplingParams(logprobs=L.max_logprobs)), gen(params=SamplingParams(logprobs=L.max_logprobs + 1))),
    (gen(params=SamplingParams(prompt_logprobs=L.max_logprobs)), gen(params=SamplingParams(prompt_logprobs=L.max_logprobs + 1))),
    (gen(params=SamplingParams(max_tokens=L.max_tokens)), gen(params=SamplingParams(max_tokens=L.max_tokens + 1))),
    (gen(params=SamplingParams(structured=StructuredOutput("choice", choices=("c",) * L.max_choices))),
     gen(params=SamplingParams(structured=StructuredOutput("choice", choices=("c",) * (L.max_choices + 1))))),
])
def test_the_coordinator_checks_each_field(coordinator, at, over):
    coordinator.check_request(at)
    with pytest.raises(LimitExceededError):
        coordinator.check_request(over)


def test_the_coordinator_holds_chat_template_kwargs_to_the_allow_list(coordinator):
    """A client of the coordinator (not only the gateway) may send a chat's chat_template_kwargs:
    the same allow-list holds there, and a prompt, which no template renders, may not carry them."""
    chat = [ChatMessage("user", "hi")]
    coordinator.check_request(gen(messages=chat, chat_template_kwargs={"enable_thinking": False}))
    for bad in ({"chat_template": "PWNED"}, {"tokenize": False}, {f"k{i}": i for i in range(L.max_template_kwargs + 1)}):
        with pytest.raises(FieldLimitExceeded) as e:
            coordinator.check_request(gen(messages=chat, chat_template_kwargs=bad))
        assert e.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs is for messages"):
        coordinator.check_request(gen(prompt="hi", chat_template_kwargs={"enable_thinking": False}))


def test_the_stop_scan_does_not_count_whitespace_between_strings():
    """json.dumps separates items with ", ": the most and longest stop strings allowed, escaped
    (CJK as \\uXXXX), must pass the scan before decoding; one more string must not."""
    import json

    from pdserve.gateway.schema import refuse_oversized

    limits = RequestLimits()
    stops = [chr(0x4e00 + i) * limits.max_stop_length for i in range(limits.max_stop)]
    refuse_oversized(json.dumps({"model": "m", "prompt": "hi", "stop": stops}, indent=4).encode(), limits)
    with pytest.raises(Exception) as e:
        refuse_oversized(json.dumps({"model": "m", "prompt": "hi", "stop": stops + ["x"]}).encode(), limits)
    assert getattr(e.value, "code", None) == "limit_exceeded"


def test_the_coordinator_bounds_tool_calls_and_a_grammar_marker(coordinator):
    from pdserve_client.protocol import ToolCall

    many = [ChatMessage("assistant", "", [ToolCall("c", "f", "{}")] * (L.max_tool_calls + 1))]
    with pytest.raises(FieldLimitExceeded):
        coordinator.check_request(gen(messages=many))
    coordinator.check_request(gen(messages=[ChatMessage("assistant", "", [ToolCall("c", "f", "{}")] * L.max_tool_calls)]))
    marker = SamplingParams(structured=StructuredOutput("regex", "a", after="x" * (L.max_structured_after + 1)))
    with pytest.raises(FieldLimitExceeded):
        coordinator.check_request(gen(params=marker))
    coordinator.check_request(gen(params=SamplingParams(structured=StructuredOutput("regex", "a", after="</think>"))))
