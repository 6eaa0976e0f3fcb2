"""The Responses API through the official openai client against a launched service (real processes on
loopback, a tiny random-weight model with the default model's tokenizer), once on a (prefill, decode)
pair and once on a colocated worker: create with a string or a message list and instructions equals
the chat completion of the same conversation (greedy: same text, same usage); streaming sends
OpenAI's events in order with increasing sequence numbers and the same text; previous_response_id
continues a held conversation (and is a 404 once unknown or not stored); GET returns a held response;
function tools (named and required tool_choice, forced by the grammar) give function_call items whose
arguments validate, streamed and not, and a two-turn loop (call, output, answer); what is not
supported is a 400 naming the field. Every KV block is free at the end. The store's bounds (count,
age, bytes) are checked on the store itself."""
import json
import time

import httpx
import openai
import pytest

from pdserve.gateway.responses import ResponseObject, ResponseStore
from pdserve_client.library import Client
from tests.helpers import wait_all_blocks_free

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
                          "required": ["city", "days"], "additionalProperties": False}}
GREEDY = dict(temperature=0, max_output_tokens=12)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # vLLM's extra: the tiny random model ends compact JSON in time


@pytest.fixture
def service(kind_service):
    """tests/gateway/conftest.py's service (a pair, then a colocated worker), shared with test_scoring.py."""
    return kind_service


@pytest.fixture
def client(service):
    with openai.OpenAI(base_url=f"{service.plan.http_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        c.served = c.models.list().data[0].id
        yield c


def chat(client, messages, max_tokens=12):
    out = client.chat.completions.create(model=client.served, messages=messages, temperature=0, max_tokens=max_tokens)
    return out.choices[0].message.content, out.usage


def test_create_equals_the_chat_completion_of_its_conversation(client):
    r = client.responses.create(model=client.served, input="Say hello.", instructions="Be brief.", **GREEDY)
    text, usage = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert r.status in ("completed", "incomplete") and (r.status == "incomplete") == (r.incomplete_details is not None)
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Good "}, {"type": "input_text", "text": "day"}]}]
    r = client.responses.create(model=client.served, input=items, **GREEDY)
    text, _ = chat(client, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Good day"}])
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"


def test_stream_sends_the_events_in_order(client):
    whole = client.responses.create(model=client.served, input="Count to five.", **GREEDY)
    with client.responses.stream(model=client.served, input="Count to five.", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    raw = list(client.responses.create(model=client.served, input="Count to five.", stream=True, **GREEDY))
    assert raw[-1].type == "response.completed" and raw[-1].response.output_text == whole.output_text


def test_previous_response_id_continues_a_held_conversation(client):
    first = client.responses.create(model=client.served, input="My name is Ada.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(model=client.served, input="What is my name?", previous_response_id=first.id, **GREEDY)
    text, usage = chat(client, [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                                {"role": "user", "content": "What is my name?"}])  # the old instructions are not carried over
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=client.served, input="x", previous_response_id="resp_unknown", **GREEDY)
    private = client.responses.create(model=client.served, input="Forget this.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(private.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=client.served, input="x", previous_response_id=private.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def check_call(item):
    args = json.loads(item.arguments)
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12 and isinstance(args["days"], int)


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"], ids=["named", "required"])
def test_function_tools_forced_blocking_streamed_and_answered(client, choice):
    ask = dict(model=client.served, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, temperature=0,
               max_output_tokens=80, parallel_tool_calls=False, extra_body=COMPACT)
    r = client.responses.create(**ask)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1, r.output
    check_call(calls[0])
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    streamed = [i for i in final.output if i.type == "function_call"]
    assert len(streamed) == 1 and streamed[0].arguments == calls[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == calls[0].arguments
    answer = client.responses.create(model=client.served, previous_response_id=r.id, tools=[WEATHER], tool_choice="none", **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}])
    assert answer.output[0].type == "message" and answer.usage.input_tokens > r.usage.input_tokens
    # the same loop without the store: the call and its output sent back as input items
    again = client.responses.create(model=client.served, tools=[WEATHER], tool_choice="none", store=False, **GREEDY, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}])
    assert again.output_text == answer.output_text and again.usage.input_tokens == answer.usage.input_tokens


@pytest.mark.parametrize("extra, param", [
    (dict(background=True), "background"), (dict(tools=[{"type": "web_search"}]), "tools"), (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(truncation="auto"), "truncation"), (dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input"), (dict(tool_choice="auto", tools=[WEATHER]), "tool_choice")])
def test_unsupported_fields_are_a_400_naming_the_field(service, client, extra, param):
    body = {"model": client.served, "input": "hi", **extra}
    r = httpx.post(f"{service.plan.http_url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_every_block_is_free_at_the_end(service):
    with Client(service.plan.client_addr, timeout=30) as c:
        stats = wait_all_blocks_free(c, timeout=10)
    assert stats["requests"].get("invalid_worker_messages", 0) == 0 and stats["requests"]["requests"] >= 10


def response(rid: str, text: str = "") -> ResponseObject:
    return ResponseObject(rid, 0, "m", "completed", [], metadata={"t": text})


def test_store_keeps_the_newest_within_count_age_and_bytes(monkeypatch):
    store = ResponseStore(count=3, ttl_s=60, nbytes=10_000)
    for i in range(4):
        store.put(response(f"r{i}"), [])
    assert store.get("r0") is None and store.get("r1") is not None  # the oldest went; r1 is now the most recently used
    store.put(response("r4"), [])
    assert store.get("r2") is None and [store.get(r) is not None for r in ("r1", "r3", "r4")] == [True] * 3
    store.put(response("big", "x" * 9000), [])  # over the byte budget with the others: the least recently used go
    assert store.get("big") is not None and store.held <= 10_000 and len(store.items) < 4
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 61)
    assert store.get("big") is None  # too old: gone when asked
    assert store.held == sum(s.nbytes for s in store.items.values())
