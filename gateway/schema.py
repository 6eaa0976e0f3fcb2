"""The OpenAI-compatible HTTP shapes of the gateway, as msgspec Structs, and the OpenAPI document.

Lifecycle: a request body is decoded once into `CompletionRequest` or `ChatCompletionRequest`
(unknown fields are ignored, as OpenAI's own server does; a wrong type names the field);
`completion_jobs()` or `chat_jobs()` turns it into one coordinator job per (prompt, sample)
with validated sampling parameters, raising `ApiError` (status + OpenAI error body) before
anything is sent. Responses and stream chunks are built from the response Structs here and
encoded with msgspec. The same Structs generate `/openapi.json` (gateway/openapi.py), so the
schema cannot drift from what the code accepts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from gateway.errors import ApiError, ErrorBody, ErrorResponse, bad_request  # noqa: F401 (re-exported)
from gateway.structured import structured_output
from wire.protocol import ChatMessage
from runtime.errors import InvalidRequestError
from runtime.params import SamplingParams

MAX_N = 128  # OpenAI's limit on choices per request
MAX_CHOICES = 1024  # prompts x n of one request: each choice is one coordinator request


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


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or lists of token ids."""

    prompt: str | list
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions; messages are rendered with the model's chat template."""

    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


def decode_body(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", _error_param(str(e))) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


class _RawSizes(msgspec.Struct):
    """A body's prompt and stop as undecoded JSON: scanning them costs a fraction of decoding."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    stop: msgspec.Raw = msgspec.Raw(b"")


def refuse_oversized(body: bytes, limits) -> None:
    """Refuse a body whose prompt string or stop list is over the limits by its JSON length
    alone, before it is decoded (an 8 MB prompt: 12 ms of scanning instead of 40 ms of decoding
    that hold the event loop). JSON escapes at most 6 bytes per byte of text, so only what is
    certainly over is refused here; the rest is checked after decoding (check_limits)."""
    try:
        raw = msgspec.json.decode(body, type=_RawSizes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # the full decode reports it
    if len(raw.stop) > 2 + limits.max_stop * (6 * limits.max_stop_length + 3):
        raise bad_request(f"stop is over the limits of {limits.max_stop} strings of {limits.max_stop_length} characters "
                          "(--max-stop, --max-stop-length)", "stop", "limit_exceeded")
    if len(raw.prompt) > 2 + 6 * limits.max_prompt_bytes and bytes(memoryview(raw.prompt)[:1]) == b'"':
        raise bad_request(f"the prompt is over {limits.max_prompt_bytes} bytes (--max-prompt-bytes)", "prompt", "limit_exceeded")


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


def completion_jobs(req: CompletionRequest, vocab_size: int, max_len: int | None = None) -> list[Job]:
    _common_checks(req)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    inputs = completion_inputs(req.prompt, vocab_size, max_len)
    sampling = sampling_kwargs(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
    return _fan_out(inputs, sampling, req.n, req.priority)


def chat_jobs(req: ChatCompletionRequest, default_max_tokens: int) -> list[Job]:
    _common_checks(req)
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = sampling_kwargs(req, limit if limit is not None else default_max_tokens, logprobs)
    return _fan_out([{"messages": [chat_message(m) for m in req.messages]}], sampling, req.n, req.priority)


def _common_checks(req: _Sampling) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


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
    if _token_ids(prompt, vocab_size):
        return [{"token_ids": list(prompt)}]
    if prompt and all(isinstance(p, list) and _token_ids(p, vocab_size) for p in prompt):
        return [{"token_ids": list(p)} for p in prompt]
    raise bad_request(f"prompt must be a string, a list of strings, or (lists of) token ids in [0, {vocab_size})", "prompt")


def _token_ids(ids: list, vocab_size: int) -> bool:
    # bool is an int in Python; JSON true is not a token id
    return bool(ids) and all(type(t) is int and 0 <= t < vocab_size for t in ids)


def chat_message(m: ChatMessageIn) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system turn
    if m.content is None or isinstance(m.content, str):
        return ChatMessage(role, m.content or "")
    if any(p.type != "text" or p.text is None for p in m.content):
        raise bad_request("only text content parts are supported", "messages")
    return ChatMessage(role, "\n".join(p.text for p in m.content))


_PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed")


def sampling_kwargs(req: _Sampling, max_tokens: int, logprobs: int | None) -> dict:
    kw = dict(max_tokens=max_tokens, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs)
    kw.update({name: getattr(req, name) for name in _PASSED_THROUGH if getattr(req, name) is not None})
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    spec = structured_output(req)
    if spec is not None:
        kw["structured"] = spec
    validate_sampling(kw)
    return kw


def validate_sampling(kw: dict) -> None:
    try:
        SamplingParams(**kw).validate()
    except InvalidRequestError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0], e.code) from None


def _fan_out(inputs: list[dict], sampling: dict, n: int, priority: int = 0) -> list[Job]:
    """n samples of each prompt; choice index = prompt index * n + sample (as vLLM orders them)."""
    if len(inputs) * n > MAX_CHOICES:
        raise bad_request(f"{len(inputs)} prompts x n={n} make {len(inputs) * n} choices; the limit is {MAX_CHOICES}", "prompt")
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
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


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
    content: str
    role: str = "assistant"


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
