"""Reasoning output through a launched service with the official openai client: a colocated
worker on a tiny random model, `--reasoning-parser deepseek_r1` and a chat template that opens
the answer with `<think>` (as DeepSeek-R1's does). The random model never closes its reasoning,
so its whole output is `reasoning_content` (vLLM's parser: no `</think>`, all reasoning), blocking
and streamed alike; the split of outputs that do close it is tested on strings
(test_tool_parsers.py) and the grammar that waits for `</think>` in the sampler
(tests/runtime/test_structured.py). Structured outputs and forced tool calls are accepted with a
reasoning parser: their grammar holds only after the reasoning, so here the output stays free."""
from pathlib import Path

import openai
import pytest

from pdserve_client.library import Client
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free

TEMPLATE = Path(__file__).resolve().parents[2] / "pdserve" / "data" / "chatml_tools.jinja"
THINKING = TEMPLATE.read_text().replace("{%- if think is defined and think %}", "{%- if true %}")  # always open <think>
ASK = [{"role": "user", "content": "Is 7 prime?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    launcher = start_cluster(d, tmp_path_factory.mktemp("logs"), prefill=0, decode=0, colocated=1, engine_args=["--kv-cache-mb", "16"],
                             coordinator_args=["--no-slo", "--chat-template", THINKING], gateway=True, http_port=free_port(),
                             gateway_args=["--chat-template", THINKING, "--reasoning-parser", "deepseek_r1"])
    with openai.OpenAI(base_url=f"{launcher.plan.http_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield launcher, client, d.name
    launcher.stop()


def test_unclosed_reasoning_is_reasoning_content_blocking_and_streamed(service):
    launcher, client, model = service
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and msg.reasoning_content and r.choices[0].finish_reason == "length"
    assert "<think>" not in msg.reasoning_content
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert reasoning == msg.reasoning_content and content == ""  # greedy: the same text, all of it reasoning


def test_structured_outputs_wait_for_the_reasoning(service):
    launcher, client, model = service
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "is_prime"}})
    msg = r.choices[0].message
    free = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, tools=tools, tool_choice="none")
    assert msg.reasoning_content == free.choices[0].message.reasoning_content  # no grammar held the reasoning
    assert free.choices[0].message.content is None and free.choices[0].message.tool_calls is None
    assert msg.tool_calls is None and msg.content is None and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, response_format={"type": "json_object"})
    free = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)  # the same prompt (no tools)
    assert r.choices[0].message.reasoning_content == free.choices[0].message.reasoning_content
    with Client(launcher.plan.client_addr, timeout=60) as c:
        assert wait_all_blocks_free(c, timeout=10.0)["active_requests"] == 0
