"""OpenAI's Responses API on the gateway: `POST /v1/responses` and `GET /v1/responses/{id}`, as the
official openai client's `responses.create` / `responses.stream` / `responses.retrieve` call them.

Lifecycle: `ResponsesRoutes(gateway)` is built once with the gateway and lends it two routes. A
create body is decoded and bounded like a chat body (gateway/parse_lane.py: `responses_bounds`),
what is not supported is refused with a 400 naming the field (`refuse_unsupported`: built-in
tools, function tools, background mode, include, reasoning, top_logprobs, truncation "auto",
input items that are not messages, content that is not text), and the request becomes a chat
completion (`chat_request`): `instructions` as the system message, then the conversation of
`previous_response_id` (its input messages and its output, as this gateway stored it; the old
instructions are not carried over, as OpenAI does), then `input` (a string is one user message).
It runs through the gateway's own chat path (jobs, fan-out, disconnect and slot handling:
Gateway.run), answered whole as a `Response` object or streamed as Responses events, each with
its `sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta per delta, response.output_text.done,
response.content_part.done, response.output_item.done, response.completed (status "incomplete"
with incomplete_details when max_output_tokens ended it, as vLLM sends it), or an `error` event.
A finished response with `store` (OpenAI's default: true) is kept in the gateway's
`ResponseStore` with its conversation: the newest RESPONSES_KEPT responses for RESPONSES_TTL_S
each, within RESPONSES_BYTES in all (per gateway process; a restart forgets them); an unknown or
forgotten id is a 404, as OpenAI answers it.
"""
from __future__ import annotations

import collections
import itertools
import time
import uuid
from dataclasses import dataclass

import msgspec
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import ApiError, bad_request
from gateway.schema import ChatCompletionRequest, ChatMessageIn, ContentPart, Job, bounded, chat_jobs, request_bounds, structured_bounds
from gateway.structured import check_jobs
from client.library import Result
from wire.limits import RequestLimits

RESPONSES_KEPT = 1000  # responses a gateway keeps for previous_response_id and GET (the least recently used go first)
RESPONSES_TTL_S = 3600.0  # and for at most this long after they finished
RESPONSES_BYTES = 64 * 2**20  # and at most this many bytes of them in all (their JSON and their conversation's text)
TEXT_PARTS = ("input_text", "output_text", "text")


# ------------------------------------------------------------------ requests


class InputItem(msgspec.Struct, kw_only=True):
    """An input item: a message ({role, content}, `type` "message" or left out); other item types are refused."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses (fields beyond these are ignored, as OpenAI's own server does)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    background: bool = False
    include: list[str] | None = None
    reasoning: dict | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


def responses_bounds(req: ResponsesRequest, limits: RequestLimits) -> None:
    """Every field a caller controls against the table of bounds, before anything else is done."""
    bounded(_responses_bounds, req, limits)


def _responses_bounds(req: ResponsesRequest, limits: RequestLimits) -> None:
    for param in ("model", "user", "previous_response_id"):
        limits.check_name(param, getattr(req, param))
    limits.check_metadata(req.metadata)
    limits.check_max_tokens("max_output_tokens", req.max_output_tokens)
    limits.check_count("tools", len(req.tools or ()), "max_tools")
    items = req.input if isinstance(req.input, list) else []
    limits.check_messages(len(items) + 1, max((len(i.content) for i in items if isinstance(i.content, list)), default=0))
    limits.check_prompt_bytes(_texts(req), len(items) + 1, "input")


def _texts(req: ResponsesRequest):
    yield req.instructions or ""
    if isinstance(req.input, str):
        yield req.input
        return
    for item in req.input:
        yield item.role or ""
        if isinstance(item.content, str):
            yield item.content
        elif item.content:
            yield from (p.text for p in item.content if p.text)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """A clear 400 naming the field, for what this server does not do."""
    if req.background:
        raise bad_request("background mode is not supported: send the request without background (stream it, or wait for it)",
                          "background")
    for tool in req.tools or ():
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools of type {kind!r} are not supported (no built-in tools run here)", "tools")
        raise bad_request("function tools are not supported on /v1/responses yet", "tools")
    if req.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice needs tools, which are not supported on /v1/responses yet", "tool_choice")
    if req.include:
        raise bad_request(f"include is not supported (asked: {', '.join(map(str, req.include))[:200]})", "include")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning options are not supported for this model", "reasoning")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {req.truncation!r} is not supported: a conversation longer than the context is refused",
                          "truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", "max_output_tokens")


def input_messages(req: ResponsesRequest) -> list[ChatMessageIn]:
    if isinstance(req.input, str):
        return [ChatMessageIn(role="user", content=req.input)]
    out = []
    for item in req.input:
        if item.type != "message" or item.role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"input items of type {item.type!r} (role {item.role!r}) are not supported: only messages of role "
                              "user, assistant, system or developer", "input")
        parts = item.content if isinstance(item.content, list) else None
        if parts is not None and any(p.type not in TEXT_PARTS or p.text is None for p in parts):
            raise bad_request("only text content (input_text, output_text) is supported", "input")
        content = "".join(p.text for p in parts) if parts is not None else item.content or ""
        out.append(ChatMessageIn(role=item.role, content=content))
    return out


def response_format(text: dict | None) -> dict | None:
    """Responses' text.format as chat's response_format (gateway/structured.py reads it)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return {"type": fmt.get("type")}


def chat_request(req: ResponsesRequest, history: list[ChatMessageIn]) -> ChatCompletionRequest:
    system = [ChatMessageIn(role="system", content=req.instructions)] if req.instructions else []
    return ChatCompletionRequest(model=req.model, messages=system + history + input_messages(req), max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, stream=req.stream, user=req.user,
                                 response_format=response_format(req.text))


# ------------------------------------------------------------------ responses and events


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list = []
    logprobs: list = []


class OutputMessage(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str = "completed"
    type: str = "message"
    role: str = "assistant"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct):
    """A response (whole, stored, or inside the created / in_progress / completed events)."""

    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = True
    error: None = None
    object: str = "response"
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"
    tools: list = []
    text: dict = {"format": {"type": "text"}}
    truncation: str = "disabled"
    background: bool = False


class ResponseEvent(msgspec.Struct, omit_defaults=True):
    """One server-sent event of a streamed response (its `type` names which; the fields it carries follow OpenAI's)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputMessage | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list | None = None
    code: str | None = None  # an error event's
    message: str | None = None
    param: str | None = None


# ------------------------------------------------------------------ the store


@dataclass
class Stored:
    response: ResponseObject
    conversation: list[ChatMessageIn]  # its input messages (no instructions) and its output: what a next turn continues
    at: float
    nbytes: int


class ResponseStore:
    """The responses this gateway still holds: at most `count`, each for `ttl_s`, `nbytes` in all (LRU)."""

    def __init__(self, count: int = RESPONSES_KEPT, ttl_s: float = RESPONSES_TTL_S, nbytes: int = RESPONSES_BYTES):
        self.count, self.ttl_s, self.nbytes = count, ttl_s, nbytes
        self.items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self.held = 0  # bytes

    def put(self, response: ResponseObject, conversation: list[ChatMessageIn]) -> None:
        size = len(msgspec.json.encode(response)) + sum(len(m.content or "") + 32 for m in conversation)
        self.items[response.id] = Stored(response, conversation, time.monotonic(), size)
        self.held += size
        while self.items and (len(self.items) > self.count or self.held > self.nbytes):
            self._drop(next(iter(self.items)))

    def get(self, rid: str) -> Stored | None:
        s = self.items.get(rid)
        if s is not None and time.monotonic() - s.at > self.ttl_s:
            self._drop(rid)
            return None
        if s is not None:
            self.items.move_to_end(rid)
        return s

    def _drop(self, rid: str) -> None:
        self.held -= self.items.pop(rid).nbytes


def not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{rid[:64]}' not found.", "previous_response_not_found" if param else "response_not_found", param)


class Turn:
    """One response being made: its id, its request, the conversation it continues; builds the
    Response object and the stream's events, and stores the finished response."""

    def __init__(self, req: ResponsesRequest, history: list[ChatMessageIn], model: str, store: ResponseStore):
        self.req, self.history, self.model, self.store = req, history, model, store
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = itertools.count()

    def response(self, status: str, text: str | None = None, result: Result | None = None) -> ResponseObject:
        r = self.req
        output = [] if text is None else [OutputMessage(self.item_id, [OutputText(text)], "incomplete" if status == "incomplete" else "completed")]
        usage = None if result is None else ResponseUsage(result.prompt_tokens, result.completion_tokens, result.prompt_tokens + result.completion_tokens)
        details = IncompleteDetails("max_output_tokens") if status == "incomplete" else None
        return ResponseObject(self.id, self.created, self.model, status, output, usage, details, r.instructions, r.max_output_tokens,
                              r.temperature, r.top_p, r.previous_response_id, r.metadata or {}, r.user, r.store,
                              text=r.text or {"format": {"type": "text"}})

    def finish(self, result: Result) -> ResponseObject:
        done = self.response("incomplete" if result.finish_reason == "length" else "completed", result.text, result)
        if self.req.store:
            self.store.put(done, self.history + input_messages(self.req) + [ChatMessageIn(role="assistant", content=result.text)])
        return done

    def whole(self, jobs: list[Job], results: list[Result]) -> ResponseObject:
        return self.finish(results[0])

    def event(self, type_: str, **fields) -> bytes:
        ev = ResponseEvent(type_, next(self.seq), **fields)
        return b"event: " + type_.encode() + b"\ndata: " + msgspec.json.encode(ev) + b"\n\n"

    def opening(self) -> list[bytes]:
        at = dict(output_index=0, content_index=0, item_id=self.item_id)
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress")),
                self.event("response.output_item.added", output_index=0, item=OutputMessage(self.item_id, [], "in_progress")),
                self.event("response.content_part.added", part=OutputText(""), **at)]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", delta=text, logprobs=[], output_index=0, content_index=0, item_id=self.item_id)

    def closing(self, result: Result) -> list[bytes]:
        done = self.finish(result)
        at = dict(output_index=0, content_index=0, item_id=self.item_id)
        return [self.event("response.output_text.done", text=result.text, logprobs=[], **at),
                self.event("response.content_part.done", part=OutputText(result.text), **at),
                self.event("response.output_item.done", output_index=0, item=done.output[0]),
                self.event("response.completed", response=done)]

    def error(self, e: ApiError) -> bytes:
        return self.event("error", code=e.code, message=e.message, param=e.param)


# ------------------------------------------------------------------ routes


class ResponsesRoutes:
    def __init__(self, gateway, store: ResponseStore | None = None):
        self.gw = gateway
        self.store = store or ResponseStore()

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])]

    async def create(self, request) -> Response:
        gw = self.gw
        gw.authorize(request)
        req = await gw.decode_request(request, ResponsesRequest)
        gw.check_model(req.model)
        refuse_unsupported(req)
        trace = gw.check_limits(request, req)
        history = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = prev.conversation
        chat = chat_request(req, history)
        request_bounds(chat, gw.cfg.limits)  # the whole conversation, with what it continues
        jobs = chat_jobs(chat, await gw.context_len())
        structured_bounds(jobs, gw.cfg.limits)
        await check_jobs(jobs)
        turn = Turn(req, history, gw.name, self.store)
        return await gw.run(request, chat, jobs, turn, trace, events=self.events)

    async def events(self, fanout, turn: Turn, jobs: list[Job], include_usage: bool):
        for ev in turn.opening():
            yield ev
        try:
            while (event := await fanout.next_event()) is not None:
                if event[1].text:
                    yield turn.delta(event[1].text)
            for ev in turn.closing(fanout.results[jobs[0].index]):
                yield ev
        except Exception as e:  # headers are sent: the error travels as an event (the openai client raises it)
            err = self.gw.api_error(e)
            self.gw.metrics.error(err.code)
            yield turn.error(err)

    async def retrieve(self, request) -> Response:
        self.gw.authorize(request)
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            raise not_found(rid)
        return Response(msgspec.json.encode(stored.response), media_type="application/json")
