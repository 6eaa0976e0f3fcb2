"""Tool calling through launched services with the official openai client (real processes on
loopback, a tiny random model with the default model's tokenizer and the repo's hermes-style
template, pdserve/data/chatml_tools.jinja, given by --chat-template).

Two launches, one per module parameter: a (prefill, decode) pair with `--enable-auto-tool-choice
--tool-call-parser hermes`, and a colocated worker without them. On both: named and required
tool calls, blocking and streamed, whose arguments validate against the function's schema
(jsonschema_rs); parallel_tool_calls=false gives exactly one call; a two-turn loop (a call, its
result as a tool message, a final answer) whose prompt is the template's rendering of the whole
history with the tools (usage.prompt_tokens equals the count rendered here); vLLM's 400s for
tool fields it refuses. `auto` answers on the pair (the tiny model writes text, so the parser
itself is tested on strings in test_tool_parsers.py) and is vLLM's 400 on the colocated worker.
At the end every KV block is free."""
import json
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest

from pdserve.common.tokenizer import load_tokenizer
from pdserve_client.library import Client
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

TEMPLATE = str(Path(__file__).resolve().parents[2] / "pdserve" / "data" / "chatml_tools.jinja")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # the tiny random model ends compact JSON within max_tokens


@pytest.fixture(scope="module", params=["pair_with_auto", "colocated"])
def service(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    auto = request.param == "pair_with_auto"
    gateway_args = ["--chat-template", TEMPLATE] + (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"] if auto else [])
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=int(auto), decode=int(auto), colocated=int(not auto),
                             engine_args=["--kv-cache-mb", "16"], coordinator_args=["--no-slo", "--chat-template", TEMPLATE],
                             gateway=True, http_port=free_port(), gateway_args=gateway_args)
    yield launcher, d.name, auto
    launcher.stop()


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service[0].plan.http_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def create(client, model, **kw):
    kw = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, "extra_body": COMPACT, **kw}
    return client.chat.completions.create(model=model, **kw)


def streamed(client, model, **kw):
    """(content, [(id, name, arguments)], finish_reason) of a streamed answer, checking OpenAI's delta order."""
    calls, content, finish = {}, "", None
    for chunk in create(client, model, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call names it; arguments follow
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and not tc.function.name
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], args)
    return args


def test_named_tool_call_blocking_and_streamed(service, client):
    _, model, _ = service
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = create(client, model, tool_choice=choice)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "tool_calls" and msg.role == "assistant" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    valid("get_weather", call.function.arguments)
    content, calls, finish = streamed(client, model, tool_choice=choice)
    assert content == "" and finish == "tool_calls" and [c[1] for c in calls] == ["get_weather"]
    assert json.loads(calls[0][2]) == json.loads(call.function.arguments)  # greedy: the same call
    # vLLM's default: any whitespace the model chooses; still the schema's arguments
    r = create(client, model, tool_choice=choice, extra_body={}, max_tokens=200)
    if r.choices[0].finish_reason == "tool_calls":  # a random model may spend the tokens on whitespace
        valid("get_weather", r.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_blocking_and_streamed(service, client, parallel):
    _, model, _ = service
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        r = create(client, model, tool_choice="required", parallel_tool_calls=parallel, max_tokens=150, **sampling)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
        assert len(msg.tool_calls) == 1 or parallel
        for c in msg.tool_calls:
            valid(c.function.name, c.function.arguments)
        content, calls, finish = streamed(client, model, tool_choice="required", parallel_tool_calls=parallel, max_tokens=150, **sampling)
        assert content == "" and finish == "tool_calls"
        assert [(name, json.loads(args)) for _, name, args in calls] == [(c.function.name, json.loads(c.function.arguments))
                                                                         for c in msg.tool_calls]


def rendered_tokens(service, messages, tools) -> int:
    tok = load_tokenizer(service[0].plan.model)
    tok.chat_template = Path(TEMPLATE).read_text()
    for m in messages:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])  # as vLLM hands them to templates
    return len(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_two_turn_loop_through_the_template(service, client):
    _, model, _ = service
    first = create(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    args = valid("get_weather", call.function.arguments)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "forecast": "sunny, 24 C"})}]
    final = create(client, model, messages=history, tool_choice="none", max_tokens=12)
    msg = final.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str) and final.choices[0].finish_reason in ("stop", "length")
    # the second prompt is the template's rendering of the call, its result and the tools: the same token count
    expected = rendered_tokens(service, [dict(m) for m in json.loads(json.dumps(history))], TOOLS)
    assert final.usage.prompt_tokens == expected > first.usage.prompt_tokens
    counted = httpx.post(f"{service[0].plan.http_url}/tokenize", json={"model": model, "messages": history, "tools": TOOLS}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] == expected, counted.text  # /tokenize renders the same


def test_auto_is_served_only_with_its_flags(service, client):
    launcher, model, auto = service
    if not auto:
        for kw in (dict(tool_choice="auto"), dict()):  # tools without tool_choice mean auto, as in vLLM
            with pytest.raises(openai.BadRequestError) as e:
                create(client, model, **kw)
            assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set' in str(e.value)
        return
    r = create(client, model, tool_choice="auto", max_tokens=16)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and (msg.content or msg.tool_calls)
    assert r.usage.prompt_tokens == rendered_tokens(service, [dict(m) for m in ASK], TOOLS)  # the tools reached the template
    content, calls, _ = streamed(client, model, max_tokens=16)
    assert (content or calls) and (content == msg.content if not calls else True)  # greedy: the same text


@pytest.mark.parametrize("body, status, message", [
    (dict(tools=[]), 400, "`tools` must not be an empty array"),
    (dict(tool_choice="required"), 400, "When using `tool_choice`, `tools` must be set."),
    (dict(tools=TOOLS, tool_choice="sometimes"), 400, "Invalid value for `tool_choice`: sometimes!"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, response_format={"type": "json_object"}), 400,
     "You can only either use constraints for structured outputs or tools, not both."),
    (dict(tools=[{"type": "function", "function": {"name": "x" * 65}}], tool_choice="required"), 400, "limit is 64"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}], tool_choice="none"), 400, "tools"),
])
def test_refusals_as_vllm_words_them(service, body, status, message):
    launcher, model, _ = service
    r = httpx.post(f"{launcher.plan.http_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


def test_every_block_is_free_at_the_end(service):
    with Client(service[0].plan.client_addr, timeout=60) as c:
        stats = wait_all_blocks_free(c, timeout=10.0)
    assert stats["active_requests"] == 0
