"""Tool calling on /v1/chat/completions, as vLLM serves it: `tools`, `tool_choice` (`none`,
`auto`, `required`, a named function) and `parallel_tool_calls`.

Lifecycle: while a body becomes jobs (gateway/schema.py's chat_jobs), `tool_plan(req, cfg)`
checks the fields with vLLM's error texts and says how the answer is made: `named` and
`required` are forced by the structured-output engine (`forced_spec`: the function's parameters
schema; for `required` a JSON array of {"name", "parameters"} objects, one of them at most
unless parallel_tool_calls; any whitespace, as vLLM's grammars), so their arguments always parse
and match the schema; `auto` runs free and the server's `--tool-call-parser`
(gateway/tool_parsers.py) finds the calls the model wrote; `none` is plain text. The tools
themselves travel to the coordinator, whose chat template renders them (`tools=`). Each choice
of the answer then gets a `CallStream` (gateway/format.py), fed the choice's content text
delta by delta: it returns the content to show and the tool-call deltas, as OpenAI streams them
(a call's index, id, type and name first, its argument text after, as it comes for `named`,
`required` and hermes calls that name their function first; for the other parsers at the end),
and `finish()` at the end. A whole
answer is `whole_calls(plan, text)`: the parser's plain extract (the slow twin the stream is
tested against).
"""
from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from pdserve.gateway.config import ToolConfig
from pdserve.gateway.errors import bad_request
from pdserve.gateway.reasoning import held_back
from pdserve.gateway.tool_parsers import PARSERS, ParsedCall, Parser
from pdserve_client.params import StructuredOutput

# ------------------------------------------------------------------ request and response shapes


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message: a request's history, or an answer."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


# ------------------------------------------------------------------ the request


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "named" | "required"
    tools: list[Tool]
    name: str | None = None  # the named function
    parallel: bool = True
    parser: Parser | None = None  # auto's
    ids: str = "openai"  # how call ids look: "openai" (chatcmpl-tool-...) or "mistral" (9 characters)


AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def tool_plan(req, cfg: ToolConfig) -> ToolPlan | None:
    """How the request's tools shape its answer; None: no tools asked for. 400s in vLLM's words."""
    tools, choice = req.tools, req.tool_choice
    if tools is not None and not tools:
        raise bad_request("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not name:
            raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}", "tool_choice.function.name")
        if all(t.function.name != name for t in tools):
            raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
        return ToolPlan("named", tools, name, parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or \"required\" "
                          "are supported.", "tool_choice")
    if choice == "auto":
        if not (cfg.auto_tool_choice and cfg.tool_parser):
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", tools, parallel=parallel, parser=PARSERS[cfg.tool_parser],
                        ids="mistral" if cfg.tool_parser == "mistral" else "openai")
    return ToolPlan(choice, tools, parallel=parallel)


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_spec(plan: ToolPlan) -> StructuredOutput | None:
    """The grammar a `named` or `required` answer is held to, or None."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t.function.name == plan.name)
        return StructuredOutput("json", json.dumps(_parameters(tool)))
    if plan.mode != "required":
        return None
    defs: dict = {}
    items = []
    for t in plan.tools:
        params = dict(_parameters(t))
        own = params.pop("$defs") if isinstance(params.get("$defs"), dict) else {}  # shared at the top, as vLLM does
        for k, v in own.items():
            if defs.setdefault(k, v) != v:
                raise bad_request(f"Tool definition '{t.function.name}' has conflicting $defs '{k}'", "tools")
        items.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutput("json", json.dumps(schema))


def template_tools(tools: list[Tool]) -> str:
    """The tools as the chat template receives them (`tools=`), as JSON text for the wire."""
    return msgspec.json.encode(tools).decode()


# ------------------------------------------------------------------ the answer


def call_id(kind: str = "openai") -> str:
    if kind == "mistral":  # Mistral's templates want 9 alphanumerics
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def whole_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer's content text."""
    if plan.mode == "named":  # nothing at all (a reasoning model cut short in its reasoning) is no call
        return None, [ToolCall(id=call_id(), function=FunctionCall(name=plan.name, arguments=text))] if text else []
    if plan.mode == "required":
        calls = _required_calls(text)
        if calls is None:
            return text, []  # cut short (finish_reason "length"): not a list yet
        return None, [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    if plan.mode == "auto":
        content, calls = plan.parser.extract(text)
        return (content, [ToolCall(id=call_id(plan.ids), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
    return text, []


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str)]


@dataclass
class _Depth:
    """Brackets outside strings as JSON text grows: (index, depth after it) for each, each character scanned once."""

    at: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> list[tuple[int, int]]:
        out = []
        for i in range(self.at, len(text)):
            ch = text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                out.append((i, self.depth))
            elif ch in "]}":
                self.depth -= 1
                out.append((i, self.depth))
        self.at = len(text)
        return out


# a call object's head when it names the function first: its arguments' object begins at the match's end
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)', re.DOTALL)


@dataclass
class _OpenCall:
    """One call object as its text grows (from `start` in the stream's text): its name once it is
    whole, then its arguments' text as it comes. A call that does not name itself first waits
    until it is complete."""

    start: int
    value: int | None = None  # where its arguments' object begins
    depth: _Depth | None = None
    sent: int = 0  # how far its arguments' text has been handed out
    ended: bool = False

    def advance(self, text: str, stream: CallStream) -> list[DeltaToolCall]:
        out = []
        if self.value is None:
            m = _HEAD.match(text, self.start)
            if m is None:
                return out
            self.value = self.sent = m.end()
            self.depth = _Depth(at=m.end())
            out.append(stream.head(json.loads(f'"{m.group(1)}"')))
        if not self.ended:
            end = next((i + 1 for i, d in self.depth.scan(text) if d == 0), None)
            self.ended = end is not None
            upto = end if end is not None else len(text)
            if upto > self.sent:
                out.append(DeltaToolCall(stream.calls - 1, function=DeltaFunction(arguments=text[self.sent:upto])))
                self.sent = upto
        return out


@dataclass
class CallStream:
    """One choice's content deltas -> (content to show, tool-call deltas). A call's arguments are
    handed out as they come when the call names its function first (hermes, required, named);
    otherwise when the call is complete, or (llama3_json, mistral, pythonic) when the output ends."""

    plan: ToolPlan
    text: str = ""  # the content text so far
    shown: int = 0  # characters of text already handed out as content
    section: int | None = None  # auto: where the tool-call section begins
    plain: bool = False  # auto: sure there is no call section
    calls: int = 0  # calls whose head was handed out
    done: int = 0  # auto: call objects (the parser's spans) wholly handed out
    open: _OpenCall | None = None  # the call being streamed
    searched: int = 0  # auto: text searched so far (for the section, then the next call's opening or closing)
    call_start: int | None = None  # auto, delimited calls: where the open call's object begins
    depth: _Depth = field(default_factory=_Depth)  # required: the list's brackets

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            head = [self.head(self.plan.name, call_id())] if delta and not self.calls else []
            return "", head + ([DeltaToolCall(0, function=DeltaFunction(arguments=delta))] if delta else [])
        if mode == "required":
            return "", self._required()
        if mode == "auto":
            return self._auto()
        return self._show(len(self.text)), []

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left at the end of the choice."""
        if self.plan.mode == "named":
            return "", []
        if self.plan.mode == "required":
            return ("", []) if self.calls else (self._show(len(self.text)), [])  # no call at all: cut short, the text is content
        if self.plan.mode != "auto" or self.section is None:
            return self._show(len(self.text)), []
        content, calls = self.plan.parser.extract(self.text)
        if not calls and not self.calls:  # no well-formed call after all: the section was content
            return self._show(len(self.text)), []
        return "", self._whole(calls[self.calls:])

    def head(self, name: str, cid: str | None = None) -> DeltaToolCall:
        """A new call's first delta: its index, id, type and name."""
        self.calls += 1
        return DeltaToolCall(self.calls - 1, cid or call_id(self.plan.ids), "function", DeltaFunction(name=name, arguments=""))

    def _whole(self, calls: list[ParsedCall]) -> list[DeltaToolCall]:
        out = []
        for c in calls:
            out += [self.head(c.name), DeltaToolCall(self.calls - 1, function=DeltaFunction(arguments=c.arguments))]
        return out

    def _show(self, upto: int) -> str:
        out = self.text[self.shown:upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return out

    def _next(self, start: int, end: int | None, whole) -> list[DeltaToolCall]:
        """The call object from `start` (complete at `end`, or None: still growing); whole():
        its ParsedCall once complete, for a call that did not name itself first."""
        if self.open is None or self.open.start != start:
            self.open = _OpenCall(start)
        out = self.open.advance(self.text if end is None else self.text[:end], self)
        if end is not None:
            if self.open.value is None:
                out += self._whole(whole())
            self.done, self.open = self.done + 1, None
        return out

    def _required(self) -> list[DeltaToolCall]:
        """The list's items, one call each: [{"name": ..., "parameters": {...}}, ...]."""
        out = []
        for i, d in self.depth.scan(self.text):
            if d == 2 and self.text[i] == "{":  # an item opens
                self.open = _OpenCall(i)
            elif d == 1 and self.open is not None and self.text[i] == "}":
                item = self.open.start
                out += self._next(item, i + 1, lambda: _required_calls(f"[{self.text[item:i + 1]}]") or [])
        if self.open is not None and self.depth.depth >= 2:
            out += self._next(self.open.start, None, None)
        return out

    def _auto(self) -> tuple[str, list[DeltaToolCall]]:
        parser = self.plan.parser
        if self.plain:
            return self._show(len(self.text)), []
        if self.section is None:
            self.section = parser.section_start(self.text, self.searched)
            self.searched = len(self.text)
            if self.section is None:
                return self._show(len(self.text) - self._undecided(parser)), []
            self.searched = self.section
        content = self._show(self.section)
        return content, self._delimited_calls(parser) if parser.call_open else []

    def _delimited_calls(self, parser: Parser) -> list[DeltaToolCall]:
        """The deltas of the calls between parser.call_open and call_close, searching only text not
        searched before (each character a bounded number of times, however many deltas)."""
        out, text = [], self.text
        while True:
            if self.call_start is None:
                i = text.find(parser.call_open, max(self.section, self.searched - len(parser.call_open) + 1))
                if i < 0:
                    self.searched = len(text)
                    return out
                self.call_start = self.searched = i + len(parser.call_open)
            end = text.find(parser.call_close, max(self.call_start, self.searched - len(parser.call_close) + 1))
            k = self.done
            out += self._next(self.call_start, end if end >= 0 else None,
                              lambda: parser.extract(text[self.section:end])[1][k:k + 1])
            if end < 0:
                self.searched = len(text)
                return out
            self.call_start, self.searched = None, end + len(parser.call_close)

    def _undecided(self, parser: Parser) -> int:
        """Characters at the end that may still open the call section (held back)."""
        if parser.anywhere:
            return held_back(self.text, parser.markers)
        head = self.text.lstrip()
        if not head or any(m.startswith(head) for m in parser.markers):
            return len(self.text)
        self.plain = True
        return 0
