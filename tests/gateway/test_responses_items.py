"""A response's output items, streamed and whole (gateway/responses.py's Turn over the chat
formatter's split), without processes: a reasoning model's `<think>` block becomes a reasoning item
before the message, an auto tool call (hermes) a function_call item; however the text is cut into
deltas, the streamed events open and close each item in order with increasing sequence numbers, and
the response they end with equals the whole one (the slow, obvious twin). Input items become the
chat turns the template renders (parallel calls one assistant turn)."""
import json

import msgspec
import pytest

from pdserve.gateway.format import ChatFormatter
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.responses import InputItem, ResponsesRequest, ResponseStore, Turn, input_messages
from pdserve.gateway.tool_parsers import PARSERS
from pdserve.gateway.tools import FunctionDef, Tool, ToolPlan
from pdserve_client.library import Result, StreamDelta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {
    "reasoning": ("<think>Paris is in France.</think>It is sunny.", REASONING_PARSERS["qwen3"], None),
    "tool_call": ("Let me check. " + CALL, None, ToolPlan("auto", [Tool(function=FunctionDef(name="get_weather"))], parser=PARSERS["hermes"])),
    "plain": ("Hello there, friend.", None, None),
}


def turn(reasoning, plan) -> Turn:
    return Turn(ResponsesRequest(model="m", input="hi"), [], "m", ResponseStore(), ChatFormatter("", 0, "m", None, plan, reasoning))


def events_of(chunks: list[bytes]) -> list[dict]:
    out = []
    for c in chunks:
        head, data = c.decode().rstrip("\n").split("\n")
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        out.append(ev)
    return out


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", list(TEXTS))
def test_streamed_items_equal_the_whole_response(name, cut):
    text, reasoning, plan = TEXTS[name]
    result = Result("r", text=text, finish_reason="stop", prompt_tokens=4, completion_tokens=9)
    whole = turn(reasoning, plan).whole([], [result])
    t = turn(reasoning, plan)
    chunks = t.opening()
    for i in range(0, len(text), cut):
        chunks += t.feed(StreamDelta(text[i:i + cut], [1]))
    chunks += t.feed(StreamDelta("", [], None, "stop", result))
    chunks += t.closing(result)
    events = events_of(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final["output"]) == strip(json.loads(msgspec.json.encode(whole.output)))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final["output"])
    for i, item in enumerate(final["output"]):  # each item's deltas add up to it, between its added and done
        added = next(k for k, e in enumerate(events) if e["type"] == "response.output_item.added" and e["output_index"] == i)
        done = next(k for k, e in enumerate(events) if e["type"] == "response.output_item.done" and e["output_index"] == i)
        deltas = "".join(e["delta"] for e in events[added:done] if e["type"].endswith(".delta"))
        assert deltas == {"message": lambda: item["content"][0]["text"], "reasoning": lambda: item["content"][0]["text"],
                          "function_call": lambda: item["arguments"]}[item["type"]]()
    want = {"reasoning": ["reasoning", "message"], "tool_call": ["message", "function_call"], "plain": ["message"]}[name]
    assert [i["type"] for i in final["output"]] == want


def test_input_items_become_chat_turns():
    req = ResponsesRequest(model="m", input=[
        InputItem(role="user", content="Weather?"),
        InputItem(type="function_call", call_id="a", name="f", arguments='{"x": 1}'),
        InputItem(type="function_call", call_id="b", name="f", arguments='{"x": 2}'),
        InputItem(type="reasoning"),
        InputItem(type="function_call_output", call_id="a", output="1"),
        InputItem(type="function_call_output", call_id="b", output="2")])
    msgs = input_messages(req)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in msgs[1].tool_calls] == ["a", "b"] and msgs[1].content is None
    assert [(m.tool_call_id, m.content) for m in msgs[2:]] == [("a", "1"), ("b", "2")]
