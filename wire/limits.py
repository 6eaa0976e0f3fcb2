"""What one request may carry: the one table of bounds, checked before any costly work
(tokenizing, template rendering, grammar compiling, fan-out).

Lifecycle: the coordinator and the HTTP gateway each hold one `RequestLimits`, built from the
same flags (`pdserve launch` hands them to both); the fields without a flag keep the defaults
written here, each with why. The gateway checks a body's fields against it (gateway/schema.py,
request_bounds) and the coordinator a GenerateRequest (coordinator/server.py, check_request),
so a client of the ZMQ port meets the same bounds as an HTTP one; the bounds that span a whole
HTTP request are the gateway's alone (max_fanout, max_request_prefill_tokens, max_scored_entries:
the coordinator sees each choice as a request of its own, bounded by the context). A large frame
or body is first scanned by its lengths alone (`oversized_frame` here, gateway/schema.py's
refuse_oversized) and refused before it is decoded when it is certainly over. A free-form JSON
value (a structured-output schema, a tool's JSON) is held to max_json_depth levels of nesting by
`nests_deeper`, a scan of its brackets that never recurses (the JSON decoders and encoders
recurse, and raise RecursionError ~1000 levels down). Each check raises `FieldLimitExceeded`
(HTTP 400 / ErrorReply, code `limit_exceeded`, naming the field and the bound) or, for what is
not a size, `InvalidRequestError`. Every check costs at most one pass over what the request
already holds; none allocates more than the request.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from pdserve.common.errors import LimitExceededError
from pdserve.common.flags import flag
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import MAX_LOGPROBS, StructuredOutput

SCAN_FIRST_BYTES = 64 * 1024  # a larger GenerateRequest frame is scanned for oversized fields before it is decoded
TRACE_HEADERS = ("traceparent", "tracestate")  # the only trace_headers keys a request may carry (W3C trace context)
# Names apply_chat_template (or the template call it makes) consumes itself: a caller's
# chat_template_kwargs never sets them (chat_template would be the caller's own Jinja source;
# vLLM refuses it for the same reason). Any other plain identifier with a plain value may pass.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "tools", "documents", "conversation", "messages", "add_generation_prompt",
    "continue_final_message", "padding", "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs",
})
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_MSGPACK_STR_HEADER = 5  # msgpack holds a string's UTF-8 bytes after a header of at most 5 bytes
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes and all (no backtracking)
# [ and { become (, ] and } become ); everything else is dropped
_AS_PARENS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_RUNS = re.compile(rb"\(+|\)+")
_LEAF_PASSES = 4  # after k passes a change of run needs a subtree k + 1 high to its left: at most len / (2k + 2) runs


class FieldLimitExceeded(LimitExceededError):
    """A bound of the table is exceeded; `param` names the request field (OpenAI's error param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _RequestHead(msgspec.Struct, tag="GenerateRequest", array_like=True):
    """A GenerateRequest frame (wire/protocol.py) with everything but its id left undecoded."""

    request_id: str
    params: msgspec.Raw
    prompt: msgspec.Raw = msgspec.Raw(b"")
    messages: msgspec.Raw = msgspec.Raw(b"")
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    add_special_tokens: msgspec.Raw = msgspec.Raw(b"")
    priority: msgspec.Raw = msgspec.Raw(b"")
    ttft_ms: msgspec.Raw = msgspec.Raw(b"")
    tpot_ms: msgspec.Raw = msgspec.Raw(b"")
    trace_headers: msgspec.Raw = msgspec.Raw(b"")
    tools: msgspec.Raw = msgspec.Raw(b"")
    chat_template_kwargs: msgspec.Raw = msgspec.Raw(b"")


class _ParamsRaw(msgspec.Struct):
    stop: msgspec.Raw = msgspec.Raw(b"")
    structured: msgspec.Raw = msgspec.Raw(b"")


def msgpack_count(raw) -> int:
    """Elements of a msgpack array or map from its header alone (0 for nil or anything else)."""
    b = bytes(memoryview(raw)[:5])
    if not b:
        return 0
    t = b[0]
    if 0x80 <= t <= 0x9F:  # fixmap, fixarray
        return t & 0x0F
    if t in (0xDC, 0xDE):
        return int.from_bytes(b[1:3], "big")
    if t in (0xDD, 0xDF):
        return int.from_bytes(b[1:5], "big")
    return 0


def nests_deeper(text: str | bytes, depth: int) -> bool:
    """Whether JSON text nests arrays and objects more than `depth` levels deep (what its strings
    hold is skipped), without recursion: its brackets alone (C string operations), a few passes that
    each drop the innermost pairs (one level, and every leaf: what is left has few runs), then one
    walk over the runs of what is left. Text that is not JSON may pass; its decoder refuses it."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _JSON_STRING.sub(b"", data).translate(_AS_PARENS, _NOT_BRACKETS)
    if brackets.count(b"(") <= depth:
        return False
    if b"(" * (depth + 1) in brackets:
        return True
    passes = min(_LEAF_PASSES, depth)
    for _ in range(passes):
        brackets = brackets.replace(b"()", b"")
    level = 0
    for run in _RUNS.findall(brackets):
        level += len(run) if run[0] == 0x28 else -len(run)  # 0x28: "("
        if level > depth - passes:
            return True
    return False


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class RequestLimits:
    # ---- with a flag (pdserve/cli.py builds it from these)
    # UTF-8 bytes of a prompt, or of a chat's roles and contents plus message_overhead a message
    max_prompt_bytes: int = flag(2**20, group="request limits", min=1, launch=True,
                                 help="UTF-8 bytes of a prompt (or a chat's messages) before tokenizing; more is a 400")
    max_stop: int = flag(64, group="request limits", min=1, launch=True, help="stop strings per request")  # OpenAI allows 4
    max_stop_length: int = flag(256, group="request limits", min=1, launch=True, help="characters of one stop string")
    max_stop_token_ids: int = 1024  # stop_token_ids per request
    # prompt tokens one request asks the workers to prefill: each prompt counts once, whatever its n
    max_request_prefill_tokens: int = flag(2**20, group="request limits", min=1, launch=True,
                                           help="prompt tokens one completions request may ask to prefill: the sum over its prompts "
                                                "(a text prompt counts its UTF-8 bytes); more is a 400")
    max_client_priority: int = flag(0, group="request limits", launch=True, help="the highest priority class a request may ask for (higher is a 400)")
    # own ttft_ms/tpot_ms allowed, as factors of the class targets
    client_target_range: tuple[float, float] = flag((1.0, 1.0), group="request limits", launch=True,
                                                    help="LO:HI: a request's own ttft_ms/tpot_ms must lie within LO..HI times its class's targets")
    # ---- named defaults (no flag): generous for any real client, small enough that no field costs more than the prompt bound
    message_overhead: int = 32  # bytes each chat message counts in max_prompt_bytes besides its text: rendering it costs a
    # template loop turn, so 200,000 empty messages count 6.4 MB, not 0 (and msgpack frames a message in <= 24 bytes)
    max_messages: int = 4096  # messages of one chat
    max_content_parts: int = 64  # content parts of one chat message (the gateway's OpenAI form)
    max_name_length: int = 256  # characters of request_id, and of the gateway's model, user and a message's name
    max_trace_header: int = 512  # characters of traceparent or tracestate (W3C: tracestate is at most 512); no other keys
    max_structured_bytes: int = 64 * 1024  # UTF-8 bytes of a structured-output spec: JSON schema text, regex, or all choices
    max_regex_length: int = 4096  # characters of a structured-output regex
    max_structured_after: int = 32  # characters of a spec's `after` marker (a reasoning end tag; a sampler decodes that many tokens a step)
    max_choices: int = 256  # options of a `choice` constraint
    max_choice_length: int = 1024  # characters of one option
    max_token_ids: int = 2**17  # ids of one prompt given as token ids (and of /detokenize's tokens); the context bounds them too
    max_prompts: int = 1024  # prompts in one completions request
    max_n: int = 128  # choices per prompt (OpenAI's limit)
    max_fanout: int = 1024  # prompts x n of one request: each choice is one coordinator request
    max_scored_entries: int = 2**21  # prompt-token scores the choices of one completions request return (prompt tokens x n x
    # (1 + top k), for echo's logprobs and for prompt_logprobs): ~64 bytes of JSON each, so ~128 MB at the bound; computed once
    # per prompt and shared by its choices, but each choice's answer repeats them (issue 38: n 128 made 8.4M tokens' worth)
    max_logprobs: int = MAX_LOGPROBS  # top alternatives per token: chat top_logprobs (OpenAI: 20), completions logprobs (vLLM: 20; OpenAI 5),
    # prompt_logprobs (vLLM's max_logprobs: 20); the prompt they score is bounded by the context
    max_tokens: int = 2**20  # tokens to generate (beyond any context served; the workers stop at the context's end anyway)
    max_tools: int = 128  # tools of one chat (OpenAI's limit)
    max_tool_name_length: int = 64  # characters of a tool's name (OpenAI: ^[a-zA-Z0-9_-]{1,64}$; vLLM does not check the form)
    max_tool_bytes: int = 64 * 1024  # JSON bytes of one tool (name, description, parameters schema): forcing a call compiles it
    max_tool_calls: int = 128  # calls of one assistant message in a chat's history
    max_metadata_keys: int = 16  # keys of a response's metadata (/v1/responses; OpenAI's limit)
    max_metadata_value: int = 512  # characters of one metadata value (OpenAI's; a key: max_metadata_key, 64)
    max_metadata_key: int = 64
    max_template_kwargs: int = 8  # keys of a chat's chat_template_kwargs (/v1/chat/completions, /tokenize)
    max_template_value: int = 256  # characters of one string value in chat_template_kwargs
    max_json_depth: int = 64  # levels of arrays and objects in a free-form JSON value: a structured-output schema (64 levels is
    # 32 nested objects with properties; OpenAI allows 10), a tool's JSON; grammar compilers and json.dumps recurse on it

    def __post_init__(self):
        lo, hi = self.client_target_range
        sizes = [v for k, v in vars(self).items() if k not in ("max_client_priority", "client_target_range")]
        if min(sizes) < 1:
            raise InvalidRequestError("request limits must be >= 1")
        if not 0 < lo <= hi:
            raise InvalidRequestError(f"client target range must be LO:HI with 0 < LO <= HI, got {lo}:{hi}")

    # ------------------------------------------------------------------ before decoding

    def oversized_frame(self, frame: bytes) -> tuple[str, str] | None:
        """(request id, why) if a GenerateRequest frame is over the limits by its msgpack lengths
        and counts alone; scanning costs ~3 ms where decoding 200,000 stop strings or messages on
        the coordinator's loop cost 20-140 ms. Only what is certainly over is refused here."""
        try:
            head = msgspec.msgpack.decode(frame, type=_RequestHead)
            params = msgspec.msgpack.decode(head.params, type=_ParamsRaw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # another message, or a bad one: the full decode says so
        h = _MSGPACK_STR_HEADER
        over = (
            (len(head.request_id) > self.max_name_length, "request_id", f"is over {self.max_name_length} characters"),
            (len(head.prompt) > self.max_prompt_bytes + h, "prompt", f"is over {self.max_prompt_bytes} bytes (--max-prompt-bytes)"),
            (msgpack_count(head.messages) > self.max_messages, "messages", f"has over {self.max_messages} messages"),
            (msgpack_count(head.token_ids) > self.max_token_ids, "token_ids", f"has over {self.max_token_ids} ids"),
            (msgpack_count(head.trace_headers) > len(TRACE_HEADERS)
             or len(head.trace_headers) > 1 + len(TRACE_HEADERS) * (2 * h + 11 + 4 * self.max_trace_header),
             "trace_headers", f"is over {len(TRACE_HEADERS)} headers of {self.max_trace_header} characters"),
            (msgpack_count(head.chat_template_kwargs) > self.max_template_kwargs, "chat_template_kwargs",
             f"has over {self.max_template_kwargs} keys"),
            (len(params.stop) > h + self.max_stop * (4 * self.max_stop_length + h), "stop",
             f"is over the limits of {self.max_stop} strings of {self.max_stop_length} characters (--max-stop, --max-stop-length)"),
            (len(params.structured) > 64 + self.max_structured_bytes + h * (self.max_choices + 2), "structured",
             f"is over {self.max_structured_bytes} bytes"),
        )
        for certain, param, why in over:
            if certain:
                return head.request_id, f"{param} {why}"
        return None

    # ------------------------------------------------------------------ after decoding

    def check_name(self, param: str, value: str | None) -> None:
        """request_id, model, user, a message's name: at most max_name_length characters."""
        if value is not None and len(value) > self.max_name_length:
            raise FieldLimitExceeded(param, f"{param} has {len(value)} characters; the limit is {self.max_name_length}")

    def check_trace_headers(self, headers: dict | None) -> None:
        for k, v in (headers or {}).items():
            if k not in TRACE_HEADERS:
                raise FieldLimitExceeded("trace_headers", f"trace_headers may hold only {' and '.join(TRACE_HEADERS)}, not {k[:64]!r}")
            if len(v) > self.max_trace_header:
                raise FieldLimitExceeded(k, f"{k} has {len(v)} characters; the limit is {self.max_trace_header}")

    def check_messages(self, count: int, parts: int = 0) -> None:
        """A chat's message count, and the most content parts of one message."""
        if count > self.max_messages:
            raise FieldLimitExceeded("messages", f"messages has {count} messages; the limit is {self.max_messages}")
        if parts > self.max_content_parts:
            raise FieldLimitExceeded("messages", f"a message has {parts} content parts; the limit is {self.max_content_parts}")

    def check_tool_calls(self, calls: int) -> None:
        """The most tool calls one message of a chat's history carries."""
        if calls > self.max_tool_calls:
            raise FieldLimitExceeded("messages", f"a message has {calls} tool calls; the limit is {self.max_tool_calls}")

    def check_tools(self, names: list[str], sizes: list[int]) -> None:
        """A chat's tools: how many, each name's length, each one's JSON bytes (their text counts in
        max_prompt_bytes too: the template renders them)."""
        if len(names) > self.max_tools:
            raise FieldLimitExceeded("tools", f"tools has {len(names)} tools; the limit is {self.max_tools}")
        for name, size in zip(names, sizes):
            if len(name) > self.max_tool_name_length:
                raise FieldLimitExceeded("tools", f"a tool's name has {len(name)} characters; the limit is {self.max_tool_name_length}")
            if size > self.max_tool_bytes:
                raise FieldLimitExceeded("tools", f"tool {name[:64]!r} has {size} bytes of JSON; the limit is {self.max_tool_bytes}")

    def check_metadata(self, metadata: dict | None) -> None:
        """A response's metadata: a few short string keys and values (they are echoed and stored)."""
        if not metadata:
            return
        if len(metadata) > self.max_metadata_keys:
            raise FieldLimitExceeded("metadata", f"metadata has {len(metadata)} keys; the limit is {self.max_metadata_keys}")
        if any(len(k) > self.max_metadata_key or len(v) > self.max_metadata_value for k, v in metadata.items()):
            raise FieldLimitExceeded("metadata", f"a metadata key is over {self.max_metadata_key} characters or a value over "
                                                 f"{self.max_metadata_value}")

    def check_prompt_bytes(self, texts, messages: int = 0, param: str = "prompt") -> int:
        """texts: the prompt, or each message's role and content; each of `messages` counts
        message_overhead more. Returns the total: the cost a tokenizing lane is chosen by."""
        n = messages * self.message_overhead
        if n > self.max_prompt_bytes:
            raise FieldLimitExceeded(param, f"{messages} messages count {n} bytes (message_overhead {self.message_overhead} each); "
                                            f"the limit is {self.max_prompt_bytes} (--max-prompt-bytes)")
        for t in texts:
            n += utf8_len(t)
            if n > self.max_prompt_bytes:
                raise FieldLimitExceeded(param, f"the {param} is over {self.max_prompt_bytes} bytes (--max-prompt-bytes)")
        return n

    def check_token_ids(self, count: int, param: str = "prompt") -> None:
        """An absolute bound on ids given by the caller; the context (when known) is checked
        too, as prompt_too_long (gateway/schema.py's completion_inputs, the coordinator's start_request)."""
        if count > self.max_token_ids:
            raise FieldLimitExceeded(param, f"{param} has {count} token ids; the limit is {self.max_token_ids}")

    def check_prefill_tokens(self, tokens: int, param: str = "prompt") -> None:
        """The prefill work of one request: the sum over its prompts of their tokens (a text prompt's
        UTF-8 bytes stand for its tokens: tokenizing comes later). Its n choices do not multiply it:
        a prompt scored is scored once and shared by them (gateway/scoring.py), and the others find
        its prefix in the prefix cache."""
        if tokens > self.max_request_prefill_tokens:
            raise FieldLimitExceeded(param, f"the prompts ask to prefill {tokens} tokens (a text prompt counting its bytes); the "
                                            f"limit is {self.max_request_prefill_tokens} (--max-request-prefill-tokens)")

    def check_scored_entries(self, entries: int, param: str) -> None:
        """What the prompt scores of one completions request make in its answer: prompt tokens x n x
        (1 + top k) for each of echo's logprobs and prompt_logprobs."""
        if entries > self.max_scored_entries:
            raise FieldLimitExceeded(param, f"the choices would return {entries} prompt-token scores (prompt tokens x n x (1 + top k) "
                                            f"for echo's logprobs and for prompt_logprobs); the limit is {self.max_scored_entries}")

    def check_count(self, param: str, count: int, limit_name: str) -> None:
        """n, prompts, fan-out: count <= the named field of the table."""
        limit = getattr(self, limit_name)
        if count > limit:
            raise FieldLimitExceeded(param, f"{param} is {count}; the limit is {limit}")

    def check_sampling(self, stop, stop_token_ids) -> None:
        if len(stop) > self.max_stop:
            raise FieldLimitExceeded("stop", f"stop has {len(stop)} strings; the limit is {self.max_stop} (--max-stop)")
        if any(len(s) > self.max_stop_length for s in stop):
            raise FieldLimitExceeded("stop", f"a stop string is over {self.max_stop_length} characters (--max-stop-length)")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise FieldLimitExceeded("stop_token_ids", f"stop_token_ids has {len(stop_token_ids)} ids; the limit is {self.max_stop_token_ids}")

    def check_max_tokens(self, param: str, value: int | None) -> None:
        if value is not None and value > self.max_tokens:
            raise FieldLimitExceeded(param, f"{param} is {value}; the limit is {self.max_tokens}")

    def check_logprobs(self, param: str, value: int | None) -> None:
        if value is not None and value > self.max_logprobs:
            raise FieldLimitExceeded(param, f"{param} is {value}; the limit is {self.max_logprobs}")

    def check_params(self, p) -> None:
        """A GenerateRequest's SamplingParams (pdserve_client/params.py), before validate()."""
        self.check_sampling(p.stop, p.stop_token_ids)
        self.check_max_tokens("max_tokens", p.max_tokens if isinstance(p.max_tokens, int) else None)
        self.check_logprobs("logprobs", p.logprobs if isinstance(p.logprobs, int) else None)
        self.check_logprobs("prompt_logprobs", p.prompt_logprobs if isinstance(p.prompt_logprobs, int) else None)
        if p.structured is not None:
            self.check_structured(p.structured)

    def check_structured(self, s: StructuredOutput, param: str = "structured") -> None:
        """Before it is compiled: the spec's bytes, a regex's length, the choices' number and length,
        a JSON schema's nesting."""
        if len(s.after) > self.max_structured_after:
            raise FieldLimitExceeded(param, f"the spec's after marker has {len(s.after)} characters; the limit is {self.max_structured_after}")
        if s.kind == "regex" and len(s.spec) > self.max_regex_length:
            raise FieldLimitExceeded(param, f"the regex has {len(s.spec)} characters; the limit is {self.max_regex_length}")
        if len(s.choices) > self.max_choices:
            raise FieldLimitExceeded(param, f"choice has {len(s.choices)} options; the limit is {self.max_choices}")
        if any(len(c) > self.max_choice_length for c in s.choices):
            raise FieldLimitExceeded(param, f"a choice option is over {self.max_choice_length} characters")
        n = utf8_len(s.spec) + sum(map(utf8_len, s.choices))
        if n > self.max_structured_bytes:
            raise FieldLimitExceeded(param, f"the structured output spec has {n} bytes; the limit is {self.max_structured_bytes}")
        if s.kind == "json":
            self.check_nesting(param, s.spec)

    def check_nesting(self, param: str, text: str | bytes, depth: int | None = None) -> None:
        """A free-form JSON value (text, already bounded in bytes) nests at most `depth` levels
        (default max_json_depth)."""
        depth = self.max_json_depth if depth is None else depth
        if nests_deeper(text, depth):
            raise FieldLimitExceeded(param, f"{param} nests arrays and objects more than {depth} levels deep (a schema or "
                                            f"other free-form JSON value may nest {self.max_json_depth})")

    def check_template_kwargs(self, kwargs: dict | None, param: str = "chat_template_kwargs") -> None:
        """An allow-list: a few plain identifiers, none that apply_chat_template consumes itself
        (never template source), each a bool, number, None or short string."""
        if not kwargs:
            return
        if len(kwargs) > self.max_template_kwargs:
            raise FieldLimitExceeded(param, f"{param} has {len(kwargs)} keys; the limit is {self.max_template_kwargs}")
        for k, v in kwargs.items():
            if not _IDENTIFIER.match(k) or k in RESERVED_TEMPLATE_KWARGS or k.startswith("return_"):
                raise FieldLimitExceeded(param, f"{param} may not set {k[:64]!r}: keys are plain identifiers, and never ones "
                                                "apply_chat_template takes itself (chat_template, tokenize, tools, return_*, ...)")
            if not (v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= self.max_template_value)):
                raise FieldLimitExceeded(param, f"{param}[{k!r}] must be a bool, a number, null or a string of at most "
                                                f"{self.max_template_value} characters")

    def check_scheduling(self, priority: int, ttft_ms: float, tpot_ms: float, class_ttft_ms: float, class_tpot_ms: float) -> None:
        """Priority at most max_client_priority; own targets within the range around the class's
        (a tighter one jumps queues, a looser one skips shedding). 0 means the class's own."""
        if priority > self.max_client_priority:
            raise InvalidRequestError(f"priority {priority} is above {self.max_client_priority}, the highest this server "
                                      "allows clients (--max-client-priority)")
        lo, hi = self.client_target_range
        for name, own, base in (("ttft_ms", ttft_ms, class_ttft_ms), ("tpot_ms", tpot_ms, class_tpot_ms)):
            if own and not lo * base <= own <= hi * base:
                raise InvalidRequestError(f"{name} {own:g} is outside [{lo * base:g}, {hi * base:g}], what this server allows "
                                          "for the request's class (--client-target-range)")
