"""/v1/responses' fields against the table of bounds (wire/limits.py) without processes: each at
its limit passes and one past it is a 400 limit_exceeded naming the field; the coordinator refuses
a request whose prompt scores could outgrow a worker message."""
import json

import pytest

from pdserve.common.errors import LimitExceededError
from pdserve.coordinator.server import check_worker_message_size
from pdserve.gateway.errors import ApiError
from pdserve.gateway.responses import ResponsesRequest, responses_bounds
from pdserve.gateway.schema import STRUCTURED_WRAPPER_BYTES, decode_body
from pdserve.wire.limits import RequestLimits
from pdserve_client.params import SamplingParams

L = RequestLimits()


def body(**fields) -> ResponsesRequest:
    return decode_body(json.dumps({"model": "m", "input": "hi", **fields}).encode(), ResponsesRequest)


def tool(name="f"):
    return {"type": "function", "name": name, "parameters": {"type": "object"}}


def text_sized(n: int) -> dict:
    """A text field whose compact JSON has exactly n bytes."""
    base = len(json.dumps({"format": {"type": "text"}, "pad": ""}, separators=(",", ":")))
    return {"format": {"type": "text"}, "pad": "p" * (n - base)}


@pytest.mark.parametrize("at, over, param", [
    (lambda: body(metadata={f"k{i}": "v" for i in range(L.max_metadata_keys)}),
     lambda: body(metadata={f"k{i}": "v" for i in range(L.max_metadata_keys + 1)}), "metadata"),
    (lambda: body(metadata={"k": "v" * L.max_metadata_value}), lambda: body(metadata={"k": "v" * (L.max_metadata_value + 1)}), "metadata"),
    (lambda: body(metadata={"k" * L.max_metadata_key: "v"}), lambda: body(metadata={"k" * (L.max_metadata_key + 1): "v"}), "metadata"),
    (lambda: body(max_output_tokens=L.max_tokens), lambda: body(max_output_tokens=L.max_tokens + 1), "max_output_tokens"),
    (lambda: body(previous_response_id="r" * L.max_name_length), lambda: body(previous_response_id="r" * (L.max_name_length + 1)),
     "previous_response_id"),
    (lambda: body(tools=[tool()] * L.max_tools), lambda: body(tools=[tool()] * (L.max_tools + 1)), "tools"),
    (lambda: body(tools=[tool("t" * L.max_tool_name_length)]), lambda: body(tools=[tool("t" * (L.max_tool_name_length + 1))]), "tools"),
    (lambda: body(input=[{"role": "user", "content": "x"}] * (L.max_messages - 1)),
     lambda: body(input=[{"role": "user", "content": "x"}] * L.max_messages), "messages"),
    (lambda: body(input="x" * (L.max_prompt_bytes - L.message_overhead)),
     lambda: body(input="x" * (L.max_prompt_bytes - L.message_overhead + 1)), "input"),
    (lambda: body(input=[{"type": "function_call", "call_id": "c" * L.max_name_length, "name": "f", "arguments": "{}"}]),
     lambda: body(input=[{"type": "function_call", "call_id": "c" * (L.max_name_length + 1), "name": "f", "arguments": "{}"}]), "input"),
    (lambda: body(text=text_sized(L.max_structured_bytes + STRUCTURED_WRAPPER_BYTES)),
     lambda: body(text=text_sized(L.max_structured_bytes + STRUCTURED_WRAPPER_BYTES + 1)), "text"),
])
def test_each_responses_bound_at_its_limit_and_one_past(at, over, param):
    responses_bounds(at(), L)
    with pytest.raises(ApiError) as e:
        responses_bounds(over(), L)
    assert (e.value.status, e.value.code, e.value.param) == (400, "limit_exceeded", param), e.value.message


def test_prompt_scores_count_in_a_worker_message():
    check_worker_message_size(8192, SamplingParams(prompt_logprobs=20), 8192)  # the default model's whole context: fits
    check_worker_message_size(60_000, SamplingParams(), 2**17)
    with pytest.raises(LimitExceededError):  # 60,000 prompt tokens with 20 alternatives each: over 16 MiB
        check_worker_message_size(60_000, SamplingParams(prompt_logprobs=20), 2**17)
