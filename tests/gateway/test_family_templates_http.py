"""Each served family's published chat template through the HTTP gateway, in this process: the
gateway's app (httpx's ASGI transport) sends to a real coordinator on loopback, which renders the
template and places the prompt on one colocated worker; that worker is a script here (it records
the prompt ids each Generate carries and answers with token ids the test chose), since what is
checked is the rendering and the parsing, not a model.

Checked, for the templates of tests/family_templates.py written into each checkpoint's
tokenizer_config.json: the prompt ids the worker receives equal HF transformers'
`apply_chat_template` of the same messages with the same chat_template_kwargs (the comparison is
the test), and /tokenize answers the same ids; a system message to Gemma 2 is a 400 in OpenAI's
error shape carrying the template's own "System role not supported"; Gemma 3 folds the system
prompt into the first user turn; Qwen3 with `enable_thinking: false` gets the empty
`<think>\\n\\n</think>\\n\\n` block, and with `--reasoning-parser qwen3` its output is split into
reasoning_content and content by default, blocking and streamed, and is all content when
thinking is off."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os

import httpx
import msgspec
import pytest

from pdserve.common.tokenizer import load_tokenizer
from pdserve.coordinator.config import CoordinatorConfig
from pdserve.coordinator.server import Coordinator
from pdserve.gateway.config import GatewayConfig, ToolConfig
from pdserve.gateway.server import Gateway
from pdserve.wire.protocol import PROTOCOL_VERSION, Generate, Hello, Role, TokenBatch, TokenOut
from pdserve_client.protocol import FinishReason
from tests.family_templates import TEMPLATES
from tests.helpers import free_port, save_family_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And 9?"}]
NO_SYSTEM = CHAT[1:]
# what each family is asked (Gemma 2 refuses a system turn; the others take one); the kwargs each case sends
CASES = [(family, CHAT if family != "gemma2" else NO_SYSTEM, None) for family in TEMPLATES]
CASES += [("qwen3", CHAT, {"enable_thinking": False}), ("qwen3", CHAT, {"enable_thinking": True})]


class ScriptedCoordinator(Coordinator):
    """A real coordinator whose one colocated worker is this script: each Generate's prompt ids are
    kept in `prompts`, and it is answered with `reply` (token ids), then a stop."""

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        self.prompts: list[list[int]] = []
        self.reply: list[int] = []
        self.on_hello(b"scripted", Hello(PROTOCOL_VERSION, "w0", Role.COLOCATED, os.getpid(), "h", "b", "m", 4096, 4096, 16))

    def send_worker(self, w, msg) -> None:
        if isinstance(msg, Generate):
            self.prompts.append(list(msg.prompt_token_ids))
            items = [TokenOut(msg.request_id, t) for t in self.reply] + [TokenOut(msg.request_id, finish_reason=FinishReason.STOP)]
            asyncio.get_running_loop().call_soon(self.on_worker, b"scripted", TokenBatch(items))


@functools.cache
def tokenizers(model_dir) -> tuple:
    """(the coordinator's, the gateway's) tokenizers of model_dir, each as that process loads it; loaded once per module."""
    return load_tokenizer(str(model_dir)), load_tokenizer(str(model_dir))


@contextlib.asynccontextmanager
async def stack(model_dir, reasoning_parser: str | None = None):
    """(an httpx client of the gateway's app, the coordinator) for model_dir, both in this process."""
    coord_tok, gw_tok = tokenizers(model_dir)
    addr = f"tcp://127.0.0.1:{free_port()}"
    coord = ScriptedCoordinator(CoordinatorConfig(addr, f"tcp://127.0.0.1:{free_port()}", model=str(model_dir), slo=False,
                                                  worker_timeout_s=600.0), coord_tok)
    running = asyncio.ensure_future(coord.run())
    gw = Gateway(GatewayConfig(coordinator=addr, model=str(model_dir), request_timeout_s=30.0,
                               tools=ToolConfig(reasoning_parser=reasoning_parser)), gw_tok)
    gw.models.open(30.0, None)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app()), base_url="http://gw", timeout=30) as c:
            yield c, coord
    finally:
        await gw.models.close()
        gw.parse_lane.close()
        coord.stopping.set()
        await running


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> a directory holding its tokenizer and published template (all the gateway and coordinator read)."""
    dirs = {}
    for family in TEMPLATES:
        dirs[family] = tmp_path_factory.mktemp(family)
        save_family_tokenizer(dirs[family], family)
    return dirs


@functools.cache
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def hf_ids(model_dir, messages, kwargs) -> list[int]:
    """The reference: HF transformers' own tokenizer class for the directory, its apply_chat_template."""
    tok = hf_tokenizer(model_dir)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **(kwargs or {})))


def chat(model, messages, kwargs=None, **extra) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    return body


@pytest.mark.parametrize("family,messages,kwargs", CASES, ids=[f"{f}-{json.dumps(k)}" for f, _, k in CASES])
def test_the_prompt_sent_is_hf_apply_chat_template(family_dirs, family, messages, kwargs):
    d = family_dirs[family]
    want = hf_ids(d, messages, kwargs)

    async def go():
        async with stack(d) as (c, coord):
            r = await c.post("/v1/chat/completions", json=chat(d.name, messages, kwargs))
            assert r.status_code == 200, r.text
            assert coord.prompts == [want]
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            body = {"model": d.name, "messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {})}
            t = await c.post("/tokenize", json=body)
            assert t.status_code == 200, t.text
            assert t.json()["tokens"] == want

    asyncio.run(go())


def test_qwen3_thinking_off_renders_the_empty_think_block(family_dirs):
    d = family_dirs["qwen3"]
    tok = tokenizers(d)[0]

    async def go():
        async with stack(d) as (c, coord):
            for kwargs in (None, {"enable_thinking": False}):
                r = await c.post("/v1/chat/completions", json=chat(d.name, CHAT, kwargs))
                assert r.status_code == 200, r.text
        return [tok.decode(p, skip_special_tokens=False) for p in coord.prompts]

    on, off = asyncio.run(go())
    assert on.endswith("<|im_start|>user\nAnd 9?<|im_end|>\n<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


def test_gemma2_refuses_a_system_message_with_a_400_naming_the_template(family_dirs):
    d = family_dirs["gemma2"]

    async def go():
        async with stack(d) as (c, coord):
            r = await c.post("/v1/chat/completions", json=chat(d.name, CHAT))
            s = await c.post("/v1/chat/completions", json=chat(d.name, CHAT, stream=True))
            t = await c.post("/tokenize", json={"model": d.name, "messages": CHAT})
            ok = await c.post("/v1/chat/completions", json=chat(d.name, NO_SYSTEM))  # the same model without it is served
            return r, s, t, ok, coord.prompts

    r, s, t, ok, prompts = asyncio.run(go())
    for resp in (r, s, t):
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and "System role not supported" in err["message"], err
    assert r.json()["error"]["code"] == "invalid_request"
    assert ok.status_code == 200 and len(prompts) == 1  # the refused ones never reached the worker


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn(family_dirs):
    d = family_dirs["gemma3"]
    tok = tokenizers(d)[0]

    async def go():
        async with stack(d) as (c, coord):
            r = await c.post("/v1/chat/completions", json=chat(d.name, CHAT))
            assert r.status_code == 200, r.text
            return coord.prompts[0]

    text = tok.decode(asyncio.run(go()), skip_special_tokens=False)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nIs 7 prime?<end_of_turn>\n")
    assert "system" not in text


def _stream_parts(lines: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:])["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                content += ch["delta"].get("content") or ""
    return reasoning, content


def test_qwen3_reasoning_is_split_by_default_and_not_when_thinking_is_off(family_dirs):
    """--reasoning-parser qwen3 (vLLM's flag and name). Thinking on (the template's default), Qwen3
    writes `<think>` itself: the scripted worker answers with that; `<think>` and `</think>` are
    plain tokens of the vocabulary, kept in the output text as Qwen3's tokenizer keeps them."""
    d = family_dirs["qwen3"]
    tok = tokenizers(d)[0]
    thought = tok.encode("<think>\nSeven has no divisors.\n</think>\n\nYes.", add_special_tokens=False)
    plain = tok.encode("No, 9 is 3 squared.", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<think>") in thought  # one token, as in Qwen3's vocabulary

    async def go():
        async with stack(d, reasoning_parser="qwen3") as (c, coord):
            out = {}
            for name, reply, kwargs in (("on", thought, None), ("off", plain, {"enable_thinking": False}),
                                        ("off_thinking_text", thought, {"enable_thinking": False})):
                coord.reply = reply
                whole = await c.post("/v1/chat/completions", json=chat(d.name, CHAT, kwargs))
                assert whole.status_code == 200, whole.text
                async with c.stream("POST", "/v1/chat/completions", json=chat(d.name, CHAT, kwargs, stream=True)) as s:
                    lines = [line async for line in s.aiter_lines() if line]
                out[name] = whole.json()["choices"][0]["message"], _stream_parts(lines)
            return out

    out = asyncio.run(go())
    msg, streamed = out["on"]
    assert (msg["reasoning_content"], msg["content"]) == ("\nSeven has no divisors.\n", "\n\nYes.")
    assert streamed == ("\nSeven has no divisors.\n", "\n\nYes.")
    msg, streamed = out["off"]
    assert msg.get("reasoning_content") is None and msg["content"] == "No, 9 is 3 squared." and streamed == ("", msg["content"])
    msg, streamed = out["off_thinking_text"]  # thinking off: nothing is taken for reasoning, whatever the text holds
    assert msg.get("reasoning_content") is None and msg["content"].startswith("<think>") and streamed == ("", msg["content"])


def test_chat_template_kwargs_are_bounded_as_on_tokenize(family_dirs):
    d = family_dirs["qwen3"]

    async def go():
        async with stack(d) as (c, coord):
            rs = [await c.post("/v1/chat/completions", json=chat(d.name, CHAT, kw))
                  for kw in ({"chat_template": "PWNED{{ messages }}"}, {"x": {"y": 1}}, {f"k{i}": i for i in range(9)})]
            return rs, coord.prompts

    rs, prompts = asyncio.run(go())
    for r in rs:
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert prompts == []


def test_the_request_carries_its_template_kwargs_on_the_wire():
    """GenerateRequest's chat_template_kwargs round-trips msgpack (no pickle), and a frame with more
    keys than the bound is refused by its header before it is decoded."""
    from pdserve.wire.limits import RequestLimits
    from pdserve_client.library import build_request
    from pdserve_client.protocol import GenerateRequest, encode

    req = build_request(None, [{"role": "user", "content": "hi"}], None, {}, chat_template_kwargs={"enable_thinking": False})
    back = msgspec.msgpack.decode(encode(req), type=GenerateRequest)
    assert back.chat_template_kwargs == {"enable_thinking": False}
    many = build_request(None, [{"role": "user", "content": "hi"}], None, {}, chat_template_kwargs={f"k{i}": i for i in range(9)})
    assert RequestLimits().oversized_frame(encode(many)) == (many.request_id, "chat_template_kwargs has over 8 keys")
    assert RequestLimits().oversized_frame(encode(req)) is None
