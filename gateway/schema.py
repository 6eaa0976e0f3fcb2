"""The OpenAI-compatible HTTP shapes of the gateway, as msgspec Structs, and the OpenAPI document.

Lifecycle: a large body is first scanned by its lengths (`refuse_oversized`: refused before
it is decoded when certainly over the bounds), then decoded once into `CompletionRequest` or
`ChatCompletionRequest` (unknown fields are ignored, as OpenAI's own server does; a wrong type
names the field; a body nested too deep for the decoder's recursion is a 400 limit_exceeded
naming the field that nests: `too_deep`); `request_bounds()` checks every field a caller
controls against the table of bounds (wire/limits.py; a free-form value's nesting too), then
`completion_jobs()` or `chat_jobs()` turns it into one coordinator job per (prompt, sample) with
validated sampling parameters and `structured_bounds()` sizes its structured-output spec before
it is compiled, each raising `ApiError` (status + OpenAI error body; a bound: 400
`limit_exceeded` naming the field) before anything is sent. Responses and stream chunks are
built from the response Structs here and encoded with msgspec. The same Structs generate
`/openapi.json` (gateway/openapi.py), so the schema cannot drift from what the code accepts.
"""
from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass
from typing import Annotated

import msgspec

from pdserve.gateway.errors import ApiError, ErrorBody, ErrorResponse, bad_request  # noqa: F401 (re-exported)
from pdserve.gateway.scoring import PromptTokenLogprob, echo_options, prompt_logprobs_asked, share_prompt_scores
from pdserve.gateway.structured import structured_output, whitespace
from pdserve.gateway.tools import DeltaToolCall, NamedToolChoice, Tool, ToolCall, ToolPlan, forced_spec, template_tools
from pdserve.wire.limits import FieldLimitExceeded, RequestLimits
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import MAX_CACHE_SALT, SamplingParams, StructuredOutput
from pdserve_client.protocol import ChatMessage
from pdserve_client.protocol import ToolCall as WireToolCall

# response_format's type and json_schema name around the schema, a choice list's quotes and commas: the
# structured-output fields of a body may hold this much more than the spec bound (their compact JSON)
STRUCTURED_WRAPPER_BYTES = 1024
CHECK_IDS_PER_TURN = 65536  # prompt token ids checked per turn of the event loop (checked_inputs: ~1 ms)
WRAPPER_LEVELS = 2  # ... and this many levels of nesting around a schema: response_format's json_schema.schema, a tool's function.parameters
# vLLM's cache_salt: only requests with the same salt share prefix-cache blocks (common/prefix_hash.py)
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT)]


# ------------------------------------------------------------------ requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share. top_k, min_p, repetition_penalty, ignore_eos, min_tokens and
    stop_token_ids are extras (vLLM's names); the openai client sends them through extra_body."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    structured_outputs: dict | None = None  # vLLM's {json | regex | choice | json_object} (gateway/structured.py)
    guided_json: dict | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    priority: int = 0  # vLLM's extra: the priority class (higher is more important; bounded by --max-client-priority)
    cache_salt: CacheSalt | None = None  # vLLM's extra: only requests with this salt share its prefix-cache blocks


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or lists of token ids."""

    prompt: str | list
    logprobs: int | None = None
    echo: bool = False  # prepend the prompt (and, with logprobs, its tokens' logprobs: gateway/scoring.py); max_tokens 0 allowed
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's logprob and its top-k alternatives


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (gateway/tools.py)
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions; messages are rendered with the model's chat template."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list[Tool] | None = None  # gateway/tools.py
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # vLLM's extra: the template's further variables (Qwen3's enable_thinking)


def decode_body(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", _error_param(str(e))) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise too_deep(body) from None


_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]')  # a string (escapes and all) or a bracket
DEEP_SCAN_TOKENS = 2**16  # strings and brackets too_deep reads to name the field, at most
_NAMED_DEPTH = RequestLimits.max_json_depth  # a top-level field nesting deeper than this is named


def too_deep(body: bytes) -> ApiError:
    """The 400 for a body nested too deep for the JSON decoder (it recurses: RecursionError ~1000
    levels down), naming the top-level field whose value nests past max_json_depth when the first
    DEEP_SCAN_TOKENS strings and brackets show it."""
    return bad_request(f"the request body nests arrays and objects too deep to decode (a JSON value may nest {_NAMED_DEPTH} "
                       "levels)", deep_field(body, _NAMED_DEPTH), "limit_exceeded")


def deep_field(body: bytes, depth: int) -> str | None:
    """The top-level key of a JSON object whose value nests more than `depth` levels, from a walk
    over its strings and brackets that ends there (or after DEEP_SCAN_TOKENS of them: None)."""
    level, key = 0, None
    for i, m in enumerate(_JSON_TOKEN.finditer(body)):
        token = m.group()
        if i == DEEP_SCAN_TOKENS:
            return None
        if token[0] == 0x22:  # '"': a key or a string value; the last one at level 1 names what follows
            key = token if level == 1 else key
        elif token in (b"[", b"{"):
            level += 1
            if level > depth + 1:
                return _key_text(key)
        else:
            level -= 1
    return None


def _key_text(key: bytes | None) -> str | None:
    try:
        return None if key is None else msgspec.json.decode(key, type=str)[:64]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def json_text(param: str, value, limits: RequestLimits) -> bytes:
    """A free-form value's compact JSON (a schema, a tool); a value nested too deep to encode is
    refused naming `param` (check its nesting with limits.check_nesting once its size is bounded)."""
    try:
        return msgspec.json.encode(value)
    except RecursionError:
        raise FieldLimitExceeded(param, f"{param} nests arrays and objects more than {limits.max_json_depth} levels deep") from None


class _RawSizes(msgspec.Struct):
    """A body's prompt, stop and messages as undecoded JSON: scanning them costs a fraction of decoding."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    stop: msgspec.Raw = msgspec.Raw(b"")
    messages: list[msgspec.Raw] = []


def refuse_oversized(body: bytes, limits: RequestLimits) -> None:
    """Refuse a body whose prompt string, stop list or message count is over the limits by its
    JSON alone, before it is decoded (an 8 MB prompt: 12 ms of scanning instead of 40 ms of
    decoding; 200,000 empty messages: 25 ms of scanning instead of 160 ms of decoding). JSON
    escapes at most 6 bytes per byte of text, so only what is certainly over is refused here;
    the rest is checked after decoding (request_bounds)."""
    try:
        raw = msgspec.json.decode(body, type=_RawSizes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # the full decode reports it
    except RecursionError:
        raise too_deep(body) from None
    if len(raw.stop) > 2 + limits.max_stop * (6 * limits.max_stop_length + 3) and _stop_over(raw.stop, limits):
        raise bad_request(f"stop is over the limits of {limits.max_stop} strings of {limits.max_stop_length} characters "
                          "(--max-stop, --max-stop-length)", "stop", "limit_exceeded")
    if len(raw.prompt) > 2 + 6 * limits.max_prompt_bytes and bytes(memoryview(raw.prompt)[:1]) == b'"':
        raise bad_request(f"the prompt is over {limits.max_prompt_bytes} bytes (--max-prompt-bytes)", "prompt", "limit_exceeded")
    bounded(limits.check_messages, len(raw.messages))


def _stop_over(stop: msgspec.Raw, limits: RequestLimits) -> bool:
    """A stop list certainly over the bounds by its strings' count or JSON lengths (whitespace
    between them is not counted: a string's JSON is at most 6 bytes a character plus its quotes)."""
    try:
        items = msgspec.json.decode(stop, type=list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False  # a single string, or a bad one: the full decode reports it
    return len(items) > limits.max_stop or any(len(i) > 6 * limits.max_stop_length + 2 for i in items)


def bounded(check, *args) -> None:
    """Run a RequestLimits check; its refusal becomes a 400 naming the field."""
    try:
        check(*args)
    except InvalidRequestError as e:
        raise bad_request(str(e), getattr(e, "param", None), e.code) from None


def request_bounds(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits, trace: dict | None = None) -> None:
    """Every field of a decoded body against the table of bounds, before any costly work
    (tokenizing, rendering, compiling, fan-out); trace: the traceparent/tracestate headers."""
    bounded(_request_bounds, req, limits, trace)


def _request_bounds(req, limits: RequestLimits, trace: dict | None) -> None:
    limits.check_name("model", req.model)
    limits.check_name("user", req.user)
    limits.check_trace_headers(trace)
    limits.check_count("n", req.n, "max_n")
    limits.check_sampling([req.stop] if isinstance(req.stop, str) else req.stop or [], req.stop_token_ids or [])
    limits.check_max_tokens("max_tokens", req.max_tokens)
    limits.check_scheduling(req.priority, 0.0, 0.0, 0.0, 0.0)
    given = [(param, json_text(param, v, limits)) for param, v in (
        ("response_format", getattr(req, "response_format", None)), ("structured_outputs", req.structured_outputs),
        ("guided_json", req.guided_json), ("guided_regex", req.guided_regex), ("guided_choice", req.guided_choice)) if v is not None]
    # before a spec is built from them (json.dumps on the loop): the spec is at least their compact JSON
    # less its wrapper (and a choice's quotes), so past this allowance it is certainly over its bound
    if sum(len(j) for _, j in given) > limits.max_structured_bytes + STRUCTURED_WRAPPER_BYTES:
        raise FieldLimitExceeded("response_format" if getattr(req, "response_format", None) else "structured_outputs",
                                 f"the structured output spec is over {limits.max_structured_bytes} bytes")
    for param, j in given:  # the schema within (checked again, exactly, as the spec: structured_bounds) and its wrapper
        limits.check_nesting(param, j, limits.max_json_depth + WRAPPER_LEVELS)
    if isinstance(req, ChatCompletionRequest):
        limits.check_max_tokens("max_completion_tokens", req.max_completion_tokens)
        limits.check_logprobs("top_logprobs", req.top_logprobs)
        chat_bounds(req.messages, limits, req.tools)
        limits.check_template_kwargs(req.chat_template_kwargs)
        if isinstance(req.tool_choice, NamedToolChoice):
            limits.check_name("tool_choice", req.tool_choice.function.name)
        prompts = 1
    else:
        limits.check_logprobs("logprobs", req.logprobs)
        limits.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        prompts, tokens = prompt_bounds(req.prompt, limits)
        limits.check_scored_entries(tokens * req.n * scores_per_token(req), "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")
    if prompts * req.n > limits.max_fanout:
        raise FieldLimitExceeded("n", f"{prompts} prompts x n={req.n} make {prompts * req.n} choices; the limit is {limits.max_fanout}")


def scores_per_token(req: CompletionRequest) -> int:
    """Scores each choice returns per prompt token: with echo and logprobs k, the token's and its top
    k; with prompt_logprobs k, again (vLLM's field); 0 when the prompt is not scored."""
    return sum(1 + k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None)


def chat_bounds(messages: list[ChatMessageIn], limits: RequestLimits, tools: list[Tool] | None = None) -> None:
    """Messages, content parts and tool calls per message, names, the tools, and the bytes they
    all render from (each message counting the table's fixed overhead): chat completions and /tokenize."""
    limits.check_messages(len(messages), max((len(m.content) for m in messages if isinstance(m.content, list)), default=0))
    limits.check_tool_calls(max((len(m.tool_calls or ()) for m in messages), default=0))
    for m in messages:
        limits.check_name("name", m.name)
        for name in (m.tool_call_id, *(t for c in m.tool_calls or () for t in (c.id, c.function.name))):
            limits.check_name("messages", name)
    tool_json = [json_text("tools", t, limits) for t in tools or ()]
    limits.check_tools([t.function.name for t in tools or ()], [len(j) for j in tool_json])
    for j in tool_json:
        limits.check_nesting("tools", j, limits.max_json_depth + WRAPPER_LEVELS)
    texts = _chat_texts(messages)
    limits.check_prompt_bytes([*texts, *(j.decode() for j in tool_json)] if tools else texts, len(messages), "messages")


def _chat_texts(messages):
    for m in messages:
        yield m.role
        if isinstance(m.content, str):
            yield m.content
        elif m.content:
            yield from (p.text for p in m.content if p.text)
        for c in m.tool_calls or ():
            yield c.function.arguments


def prompt_bounds(prompt, limits: RequestLimits) -> tuple[int, int]:
    """A completions prompt in any of its forms against the table, each prompt and then the prefill
    they ask for together (max_request_prefill_tokens); returns (how many prompts it holds, their
    tokens as that bound counts them)."""
    if isinstance(prompt, str):
        tokens = limits.check_prompt_bytes([prompt])
        limits.check_prefill_tokens(tokens)
        return 1, tokens
    if not prompt or not isinstance(prompt[0], (str, list)):  # one prompt as token ids (or a bad form: completion_inputs says)
        limits.check_token_ids(len(prompt))
        limits.check_prefill_tokens(len(prompt))
        return 1, len(prompt)
    limits.check_count("prompt", len(prompt), "max_prompts")
    tokens = 0
    for p in prompt:
        if isinstance(p, str):
            tokens += limits.check_prompt_bytes([p])
        elif isinstance(p, list):
            limits.check_token_ids(len(p))
            tokens += len(p)
    limits.check_prefill_tokens(tokens)
    return len(prompt), tokens


def structured_bounds(jobs: list[Job], limits: RequestLimits) -> None:
    """The request's structured-output spec (every job shares it), before it is compiled."""
    spec: StructuredOutput | None = jobs[0].sampling.get("structured") if jobs else None
    if spec is not None:
        bounded(limits.check_structured, spec, "response_format" if spec.kind in ("json", "json_object") else "structured_outputs")


def _error_param(text: str) -> str | None:
    m = re.search(r"at `\$\.(\w+)", text)  # msgspec ends its message with "- at `$.field...`"
    return m.group(1) if m else None


# ------------------------------------------------------------------ request -> coordinator jobs


@dataclass
class Job:
    """One coordinator request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    inputs: dict  # prompt= | token_ids= | messages= for AsyncClient.stream
    sampling: dict  # SamplingParams fields
    priority: int = 0
    scores_from: int | None = None  # the choice whose prompt scores this one shares (gateway/scoring.py: share_prompt_scores)


def completion_jobs(req: CompletionRequest, vocab_size: int, max_len: int | None = None, inputs: list[dict] | None = None) -> list[Job]:
    """inputs: completion_inputs(req.prompt, ...) if already made (checked_inputs, on the event loop)."""
    _common_checks(req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    echo = echo_options(req)
    if inputs is None:
        inputs = completion_inputs(req.prompt, vocab_size, max_len)
    max_tokens = 1 if echo.drop_output else req.max_tokens if req.max_tokens is not None else 16  # max_tokens 0: 1 sampled, dropped
    sampling = sampling_kwargs(req, max_tokens, req.logprobs, prompt_logprobs=prompt_logprobs_asked(req, echo))
    return share_prompt_scores(_fan_out(inputs, sampling, req.n, req.priority))


def chat_jobs(req: ChatCompletionRequest, default_max_tokens: int, plan: ToolPlan | None = None, reasoning=None) -> list[Job]:
    """plan: how its tools shape the answer (gateway/tools.py: tool_plan); reasoning: the server's
    --reasoning-parser (gateway/reasoning.py), whose end marker a structured output waits for."""
    _common_checks(req)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = sampling_kwargs(req, limit if limit is not None else default_max_tokens, logprobs, forced_spec(plan) if plan else None)
    if reasoning is not None and sampling.get("structured") is not None:  # the grammar holds once the reasoning ends, as in vLLM
        sampling["structured"] = msgspec.structs.replace(sampling["structured"], after=reasoning.end)
    inputs = {"messages": [chat_message(m) for m in req.messages]}
    if req.tools:
        inputs["tools"] = template_tools(req.tools)
    if req.chat_template_kwargs:
        inputs["chat_template_kwargs"] = req.chat_template_kwargs
    return _fan_out([inputs], sampling, req.n, req.priority)


def _common_checks(req: _Sampling) -> None:
    if req.n < 1:  # its upper bound is the table's (request_bounds)
        raise bad_request(f"n must be >= 1, got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


async def checked_inputs(prompt, vocab_size: int, max_len: int | None = None) -> list[dict]:
    """completion_inputs of a list of prompts, about CHECK_IDS_PER_TURN token ids at a time with the
    event loop's other work between (8 prompts of 131,072 ids took 12-36 ms at once)."""
    if not (isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, list) for p in prompt)):
        return completion_inputs(prompt, vocab_size, max_len)
    out, ids = [], 0
    for p in prompt:
        out += completion_inputs([p], vocab_size, max_len)
        ids += len(p)
        if ids >= CHECK_IDS_PER_TURN:
            await asyncio.sleep(0)
            ids = 0
    return out


def completion_inputs(prompt, vocab_size: int, max_len: int | None = None) -> list[dict]:
    """max_len: the context, when known; a longer list of token ids is refused before its ids are
    checked one by one (an 8 MB body holds millions)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    ids = ([prompt] if not isinstance(prompt[0], list) else prompt) if prompt and not isinstance(prompt[0], str) else []
    longest = max((len(p) for p in ids if isinstance(p, list)), default=0)
    if max_len is not None and longest > max_len:  # as the coordinator words it
        raise bad_request(f"prompt has {longest} tokens; this model's context is {max_len} tokens (prompt + output)", "prompt",
                          "prompt_too_long")
    if prompt and all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if (one := token_ids(prompt, vocab_size)) is not None:
        return [{"token_ids": one}]
    many = [token_ids(p, vocab_size) if isinstance(p, list) else None for p in prompt] if prompt else [None]
    if None not in many:
        return [{"token_ids": p} for p in many]
    raise bad_request(f"prompt must be a string, a list of strings, or (lists of) token ids in [0, {vocab_size})", "prompt")


def token_ids(ids: list, vocab_size: int) -> list[int] | None:
    """ids as a new list if it is a non-empty list of token ids in [0, vocab_size), else None;
    checked in C (msgspec: ~1 ms for 131,072 ids, a Python loop took 7), as the event loop does it.
    JSON true is not a token id (bool is an int in Python; msgspec refuses it)."""
    if not ids:
        return None
    try:
        return msgspec.convert(ids, _ids_type(vocab_size))
    except msgspec.ValidationError:
        return None


@functools.lru_cache(maxsize=16)
def _ids_type(vocab_size: int):
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def chat_message(m: ChatMessageIn) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system turn
    calls = [WireToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls] if m.tool_calls else None
    if m.content is None or isinstance(m.content, str):
        return ChatMessage(role, m.content or "", calls, m.tool_call_id, m.name)
    if any(p.type != "text" or p.text is None for p in m.content):
        raise bad_request("only text content parts are supported", "messages")
    return ChatMessage(role, "\n".join(p.text for p in m.content), calls, m.tool_call_id, m.name)


_PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed")


def sampling_kwargs(req: _Sampling, max_tokens: int, logprobs: int | None, forced: StructuredOutput | None = None,
                    prompt_logprobs: int | None = None) -> dict:
    """forced: the grammar a required or named tool_choice holds the answer to (gateway/tools.py);
    prompt_logprobs: the prompt's scores asked of the prefill pass (gateway/scoring.py)."""
    kw = dict(max_tokens=max_tokens, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs)
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = prompt_logprobs
    kw.update({name: getattr(req, name) for name in _PASSED_THROUGH if getattr(req, name) is not None})
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.cache_salt is not None:
        kw["cache_salt"] = req.cache_salt
    spec = structured_output(req)
    if spec is not None and forced is not None:
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.", "tool_choice")
    spec = spec or forced
    if spec is not None:
        kw["structured"] = whitespace(spec, req.structured_outputs)
    validate_sampling(kw)
    return kw


def validate_sampling(kw: dict) -> None:
    try:
        SamplingParams(**kw).validate()
    except InvalidRequestError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0], e.code) from None


def _fan_out(inputs: list[dict], sampling: dict, n: int, priority: int = 0) -> list[Job]:
    """n samples of each prompt; choice index = prompt index * n + sample (as vLLM orders them).
    How many there may be is the table's bound (request_bounds: max_fanout)."""
    jobs = []
    for p, given in enumerate(inputs):
        for i in range(n):
            kw = dict(sampling)
            if kw.get("seed") is not None and i:
                kw["seed"] = sampling["seed"] + i  # distinct but reproducible samples
                validate_sampling(kw)
            jobs.append(Job(p * n + i, p, given, kw, priority))
    return jobs


# ------------------------------------------------------------------ responses


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    """Over the output, or (echo) the prompt and the output: the prompt's first token's entries are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None  # vLLM's: with prompt_logprobs asked


class CompletionResponse(msgspec.Struct):
    """A whole completion, or (with object "text_completion" too, as OpenAI does) one stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct):
    content: str | None  # null when the answer is tool calls only
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # --reasoning-parser (gateway/reasoning.py)


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class Model(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int | None = None
    object: str = "model"
    owned_by: str = "pdserve"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"
