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

from pdserve.gateway.errors import ApiError, bad_request
from pdserve.gateway.format import ChatFormatter
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.schema import (
    STRUCTURED_WRAPPER_BYTES,
    WRAPPER_LEVELS,
    CacheSalt,
    ChatCompletionRequest,
    ChatMessageIn,
    ContentPart,
    Job,
    bounded,
    chat_jobs,
    json_text,
    request_bounds,
    structured_bounds,
)
from pdserve.gateway.structured import check_jobs
from pdserve.gateway.tools import FunctionCall, FunctionDef, NamedFunction, NamedToolChoice, Tool, ToolCall, tool_plan
from pdserve.wire.limits import FieldLimitExceeded, RequestLimits
from pdserve_client.library import Result, StreamDelta

RESPONSES_KEPT = 1000  # responses a gateway keeps for previous_response_id and GET (the least recently used go first)
RESPONSES_TTL_S = 3600.0  # and for at most this long after they finished
RESPONSES_BYTES = 64 * 2**20  # and at most this many bytes of them in all (their JSON and their conversation's text)
TEXT_PARTS = ("input_text", "output_text", "text")


# ------------------------------------------------------------------ requests


class InputItem(msgspec.Struct, kw_only=True):
    """An input item: a message ({role, content}, `type` "message" or left out), a function call
    the model made earlier, or its output; a reasoning item is dropped (never shown to the model again)."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None  # function_call and function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | None = None  # function_call_output


class FunctionTool(msgspec.Struct, kw_only=True):
    """A tool as the Responses API gives it (flat, not under "function"); only type "function" runs here."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


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
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool = True
    background: bool = False
    include: list[str] | None = None
    reasoning: dict | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    structured_outputs: dict | None = None  # vLLM's extra (gateway/structured.py), e.g. {"disable_any_whitespace": true}
    cache_salt: CacheSalt | None = None  # vLLM's extra: only requests with this salt share its prefix-cache blocks


def responses_bounds(req: ResponsesRequest, limits: RequestLimits) -> None:
    """Every field a caller controls against the table of bounds, before anything else is done
    (the chat it becomes is bounded again, with the conversation it continues: chat_request)."""
    bounded(_responses_bounds, req, limits)


def _responses_bounds(req: ResponsesRequest, limits: RequestLimits) -> None:
    for param in ("model", "user", "previous_response_id"):
        limits.check_name(param, getattr(req, param))
    limits.check_metadata(req.metadata)
    text = json_text("text", req.text, limits) if req.text is not None else b""
    if len(text) > limits.max_structured_bytes + STRUCTURED_WRAPPER_BYTES:
        raise FieldLimitExceeded("text", f"text (its format's schema) is over {limits.max_structured_bytes} bytes")
    limits.check_nesting("text", text, limits.max_json_depth + WRAPPER_LEVELS)
    limits.check_max_tokens("max_output_tokens", req.max_output_tokens)
    tools = req.tools or []
    tool_json = [json_text("tools", t, limits) for t in tools]
    limits.check_tools([t.name or "" for t in tools], [len(j) for j in tool_json])
    for j in tool_json:
        limits.check_nesting("tools", j, limits.max_json_depth + WRAPPER_LEVELS)
    items = req.input if isinstance(req.input, list) else []
    limits.check_messages(len(items) + 1, max((len(i.content) for i in items if isinstance(i.content, list)), default=0))
    for item in items:
        limits.check_name("input", item.call_id)
        limits.check_name("input", item.name)
    limits.check_prompt_bytes(_texts(req), len(items) + 1, "input")


def _texts(req: ResponsesRequest):
    yield req.instructions or ""
    if isinstance(req.input, str):
        yield req.input
        return
    for item in req.input:
        yield from (t for t in (item.role, item.arguments, item.output) if t)
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
        if tool.type != "function":
            raise bad_request(f"tools of type {tool.type[:64]!r} are not supported: only function tools (no built-in tools run here)",
                              "tools")
    if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") != "function":
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    if req.include:
        raise bad_request(f"include is not supported (asked: {', '.join(map(str, req.include))[:200]})", "include")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning options are not supported (a model's reasoning is split out by --reasoning-parser)", "reasoning")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {req.truncation[:64]!r} is not supported: a conversation longer than the context is refused",
                          "truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", "max_output_tokens")


def input_messages(req: ResponsesRequest) -> list[ChatMessageIn]:
    """The input as chat messages: a function_call joins the assistant turn before it (parallel calls
    are one turn), its output is a tool turn."""
    if isinstance(req.input, str):
        return [ChatMessageIn(role="user", content=req.input)]
    out: list[ChatMessageIn] = []
    for item in req.input:
        if item.type == "function_call":
            call = ToolCall(id=item.call_id or "", function=FunctionCall(name=item.name or "", arguments=item.arguments or "{}"))
            if not (out and out[-1].role == "assistant" and out[-1].tool_calls is not None):
                out.append(ChatMessageIn(role="assistant", content=None, tool_calls=[]))
            out[-1].tool_calls.append(call)
        elif item.type == "function_call_output":
            out.append(ChatMessageIn(role="tool", content=item.output or "", tool_call_id=item.call_id))
        elif item.type == "message" and item.role in ("user", "assistant", "system", "developer"):
            out.append(ChatMessageIn(role=item.role, content=_text_of(item.content)))
        elif item.type != "reasoning":
            raise bad_request(f"input items of type {item.type[:64]!r} (role {str(item.role)[:64]!r}) are not supported: messages "
                              "(user, assistant, system, developer), function_call and function_call_output", "input")
    return out


def _text_of(content) -> str:
    if not isinstance(content, list):
        return content or ""
    if any(p.type not in TEXT_PARTS or p.text is None for p in content):
        raise bad_request("only text content (input_text, output_text) is supported", "input")
    return "".join(p.text for p in content)


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
    tools = [Tool(function=FunctionDef(name=t.name or "", description=t.description, parameters=t.parameters, strict=t.strict))
             for t in req.tools or ()] or None
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = NamedToolChoice(function=NamedFunction(name=str(choice.get("name") or "")))
    return ChatCompletionRequest(model=req.model, messages=system + history + input_messages(req), max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, stream=req.stream, user=req.user,
                                 response_format=response_format(req.text), tools=tools, tool_choice=choice,
                                 parallel_tool_calls=req.parallel_tool_calls, structured_outputs=req.structured_outputs,
                                 cache_salt=req.cache_salt)


# ------------------------------------------------------------------ responses and events


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list = []
    logprobs: list = []


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"

    def add(self, text: str) -> None:
        self.content[0].text += text


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "completed"

    def add(self, text: str) -> None:
        self.arguments += text


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list = []

    def add(self, text: str) -> None:
        self.content[0].text += text


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
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
    output: list[OutputItem]
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
    tools: list[FunctionTool] = []
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    error: None = None
    object: str = "response"
    text: dict = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
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
    item: OutputItem | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
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
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
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


def _choice(choice: str | dict | None) -> str | dict:
    """tool_choice as the response echoes it (a named one: its type and name only)."""
    if isinstance(choice, dict):
        return {"type": "function", "name": str(choice.get("name"))}
    return choice or "auto"


def not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{rid[:64]}' not found.", "previous_response_not_found" if param else "response_not_found", param)


class Turn:
    """One response being made: its id, its request, the conversation it continues. Its output items
    come from the chat formatter's split of the text (gateway/format.py: reasoning, content, tool
    calls); a stream opens an item when its kind of text starts and closes it when another starts
    or the response ends, with OpenAI's events. The finished response is stored (with `store`)."""

    def __init__(self, req: ResponsesRequest, history: list[ChatMessageIn], model: str, store: ResponseStore, chat: ChatFormatter):
        self.req, self.history, self.model, self.store, self.chat = req, history, model, store, chat
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = itertools.count()
        self.items: list = []  # the output so far
        self.open = None  # the item text is going to (a stream's)

    def response(self, status: str, result: Result | None = None) -> ResponseObject:
        r = self.req
        usage = None if result is None else ResponseUsage(result.prompt_tokens, result.completion_tokens,
                                                          result.prompt_tokens + result.completion_tokens)
        details = IncompleteDetails("max_output_tokens") if status == "incomplete" else None
        return ResponseObject(self.id, self.created, self.model, status, list(self.items), usage, details, r.instructions,
                              r.max_output_tokens, r.temperature, r.top_p, r.previous_response_id, r.metadata or {}, r.user, r.store,
                              r.tools or [], _choice(r.tool_choice), r.parallel_tool_calls, text=r.text or {"format": {"type": "text"}})

    def finish(self, result: Result) -> ResponseObject:
        done = self.response("incomplete" if result.finish_reason == "length" else "completed", result)
        if self.req.store:
            self.store.put(done, self.history + input_messages(self.req) + [self.assistant_turn()])
        return done

    def assistant_turn(self) -> ChatMessageIn:
        """The output as the assistant turn a next response continues (its reasoning is not shown again)."""
        text = "".join(i.content[0].text for i in self.items if isinstance(i, OutputMessage))
        calls = [ToolCall(id=i.call_id, function=FunctionCall(name=i.name, arguments=i.arguments)) for i in self.items
                 if isinstance(i, FunctionCallItem)]
        return ChatMessageIn(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)

    def whole(self, jobs: list[Job], results: list[Result]) -> ResponseObject:
        message, _ = self.chat.message(results[0])
        if message.reasoning_content:
            self.items.append(ReasoningItem(f"rs_{uuid.uuid4().hex}", [ReasoningText(message.reasoning_content)]))
        if message.content or not message.tool_calls:
            status = "incomplete" if results[0].finish_reason == "length" else "completed"
            self.items.append(OutputMessage(f"msg_{uuid.uuid4().hex}", [OutputText(message.content or "")], status))
        self.items += [FunctionCallItem(f"fc_{uuid.uuid4().hex}", c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        return self.finish(results[0])

    # ---- streaming

    def event(self, type_: str, **fields) -> bytes:
        ev = ResponseEvent(type_, next(self.seq), **fields)
        return b"event: " + type_.encode() + b"\ndata: " + msgspec.json.encode(ev) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, d: StreamDelta) -> list[bytes]:
        """The events one coordinator delta makes (the last one, with finish_reason, flushes what the split held back)."""
        out = []
        for chunk in self.chat.chunks(0, d):
            delta = chunk.choices[0].delta
            if delta.reasoning_content:
                out += self.text(ReasoningItem, delta.reasoning_content)
            if delta.content:
                out += self.text(OutputMessage, delta.content)
            for call in delta.tool_calls or ():
                out += self.call(call)
        return out

    def text(self, kind, text: str) -> list[bytes]:
        out = []
        if not isinstance(self.open, kind):
            new = ReasoningItem(f"rs_{uuid.uuid4().hex}", [ReasoningText("")]) if kind is ReasoningItem else \
                OutputMessage(f"msg_{uuid.uuid4().hex}", [OutputText("")], "in_progress")
            out += self.start(new)
        self.open.add(text)
        at = self.at()
        name = "response.reasoning_text.delta" if kind is ReasoningItem else "response.output_text.delta"
        return out + [self.event(name, delta=text, **at, **({} if kind is ReasoningItem else {"logprobs": []}))]

    def call(self, c) -> list[bytes]:
        out = []
        if c.id is not None:  # a new call: its id and name come first, its arguments after
            out += self.start(FunctionCallItem(f"fc_{uuid.uuid4().hex}", c.id, c.function.name, "", "in_progress"))
        args = c.function.arguments if c.function is not None else None
        if args and isinstance(self.open, FunctionCallItem):
            self.open.add(args)
            out.append(self.event("response.function_call_arguments.delta", delta=args, item_id=self.open.id, output_index=len(self.items) - 1))
        return out

    def at(self) -> dict:
        return dict(output_index=len(self.items) - 1, content_index=0, item_id=self.open.id)

    def start(self, item) -> list[bytes]:
        out = self.close()
        self.items.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if isinstance(item, OutputMessage):
            out.append(self.event("response.content_part.added", part=OutputText(""), **self.at()))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.items) - 1
        if not isinstance(item, ReasoningItem):
            item.status = status if isinstance(item, OutputMessage) else "completed"
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            out = [self.event("response.output_text.done", text=text, logprobs=[], output_index=i, content_index=0, item_id=item.id),
                   self.event("response.content_part.done", part=OutputText(text), output_index=i, content_index=0, item_id=item.id)]
        elif isinstance(item, FunctionCallItem):
            out = [self.event("response.function_call_arguments.done", arguments=item.arguments, name=item.name, item_id=item.id, output_index=i)]
        else:
            out = [self.event("response.reasoning_text.done", text=item.content[0].text, output_index=i, content_index=0, item_id=item.id)]
        return out + [self.event("response.output_item.done", output_index=i, item=item)]

    def closing(self, result: Result) -> list[bytes]:
        out = [] if self.items else self.start(OutputMessage(f"msg_{uuid.uuid4().hex}", [OutputText("")], "in_progress"))
        out += self.close("incomplete" if result.finish_reason == "length" else "completed")  # nothing said: an empty message, as whole
        done = self.finish(result)
        return out + [self.event("response.completed", response=done)]

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
        m = gw.model(request, req.model)
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
        plan, reasoning = tool_plan(chat, gw.cfg.tools), REASONING_PARSERS.get(gw.cfg.tools.reasoning_parser)
        jobs = chat_jobs(chat, await m.context_len(gw.cfg.stats_timeout_s), plan, reasoning)
        structured_bounds(jobs, gw.cfg.limits)
        await check_jobs(jobs)
        turn = Turn(req, history, m.name, self.store, ChatFormatter("", 0, m.name, m.text, plan, reasoning))
        return await gw.run(request, m, chat, jobs, turn, trace, events=self.events)

    async def events(self, fanout, turn: Turn, jobs: list[Job], include_usage: bool):
        for ev in turn.opening():
            yield ev
        try:
            while (event := await fanout.next_event()) is not None:
                for ev in turn.feed(event[1]):
                    yield ev
            for ev in turn.closing(fanout.results[jobs[0].index]):
                yield ev
        except Exception as e:  # headers are sent: the error travels as an event (the openai client raises it)
            err = self.gw.api_error(e)
            fanout.metrics.error(err.code)
            yield turn.error(err)

    async def retrieve(self, request) -> Response:
        self.gw.authorize(request)
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            raise not_found(rid)
        return Response(msgspec.json.encode(stored.response), media_type="application/json")
