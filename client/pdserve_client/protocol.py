"""The messages between a client and the coordinator's client port, as msgspec Structs, and the
codec every pdserve socket uses. The one copy: the engine's coordinator and gateway import these,
and its worker messages (wire/protocol.py) are built on the same `Message` base.

Lifecycle of one request on the client port: the client sends GenerateRequest; the coordinator
answers with Delta messages and one Final, or an ErrorReply at any point. AbortRequest ends a
request early, StatusRequest asks whether one is still known, StatsRequest -> StatsReply gives
the cluster's stats. (A launcher's messages, NodeReport and DrainWorker, go to the worker port:
wire/protocol.py.) Each socket has one typed
decoder over the union of what may arrive on it (`decoder`); no pickle anywhere.
"""
from __future__ import annotations

import enum
from typing import Union

import msgspec

from pdserve_client.params import SamplingParams

MAX_CONTROL_MESSAGE = 16 * 2**20  # bytes; every control socket sets ZMQ_MAXMSGSIZE to this
# a prompt token's score (the engine's runtime/scoring.py PromptScore): its logprob, its rank, the top-k [(token id, logprob)]
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or the model's context
    ABORT = 2  # cancelled by the client or the system


class Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The base of every message on every pdserve socket: tagged by class name, sent as an array."""


# ------------------------------------------------------------------ client <-> coordinator

class ToolCall(msgspec.Struct, omit_defaults=True, gc=False):
    """A call an assistant turn made, as the chat template is shown it (arguments: JSON text)."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, omit_defaults=True, gc=False):
    role: str
    content: str
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None


class GenerateRequest(Message):
    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True
    priority: int = 0  # higher is more important; picks the class's latency targets
    ttft_ms: float = 0.0  # this request's own p99 targets; 0 = its priority class's
    tpot_ms: float = 0.0
    trace_headers: dict[str, str] | None = None  # W3C traceparent / tracestate: the coordinator's span joins that trace
    tools: str | None = None  # a chat's tools (OpenAI's list, as JSON text): the chat template gets them as tools=
    # a chat's extra template variables (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking): plain values only
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None


class AbortRequest(Message):
    request_id: str


class StatsRequest(Message):
    pass


class StatusRequest(Message):
    """A client that heard nothing for a while asks whether its request is still known;
    the coordinator answers ErrorReply("unknown_request") if not (e.g. after a restart)."""

    request_id: str


class Delta(Message):
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # once, before the first token, when params.prompt_logprobs asked: the prompt's ids and a score per id after the first
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None


class Final(Message):
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft: float  # seconds from arrival at the coordinator to the first token
    token_times: list[float]  # seconds since arrival of each output token
    stop_text: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None


class ErrorReply(Message):
    request_id: str
    code: str  # pdserve_client.errors / the engine's runtime.errors code: invalid_request, prompt_too_long, no_workers, ...
    message: str
    retry_after_s: float = 0.0  # > 0: when a retry can succeed (cold_start: a worker is starting)


class StatsReply(Message):
    json: bytes  # msgspec-JSON encoded stats document (free-form, for humans and dashboards)


ClientToCoordinator = Union[GenerateRequest, AbortRequest, StatsRequest, StatusRequest]
CoordinatorToClient = Union[Delta, Final, ErrorReply, StatsReply]


# ------------------------------------------------------------------ codecs

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(union) -> msgspec.msgpack.Decoder:
    """One typed decoder per socket; anything else raises msgspec.ValidationError/DecodeError."""
    return msgspec.msgpack.Decoder(union)
