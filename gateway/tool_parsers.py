"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`, vLLM's names): each finds
the calls a model wrote in its own format in the generated text.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, ...);
  text before the first tag is content.
- `llama3_json`: the output is `<|python_tag|>` or `{` then JSON objects `{"name", "parameters"
  | "arguments"}`, separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON list `[{"name", "arguments"}]`, or (newer tokenizers)
  `[TOOL_CALLS]name[ARGS]{...}` per call; text before is content.
- `pythonic`: the output is a Python list of calls `[f(a=1), g(b="x")]` with literal arguments.

Lifecycle: stateless; `PARSERS[name].extract(text)` returns (content, [ParsedCall]) and gives
([], the whole text as content) when the text holds no well-formed call, as vLLM does.
Streaming goes through gateway/tools.py's `CallStream`, which asks each parser where a call
section may begin (`section_start`) and, for hermes, the strings that open and close each call object (`call_open`, `call_close`),
so that a call's arguments stream as they come.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _call(obj, args_key: str = "arguments") -> ParsedCall | None:
    """A parsed {"name": ..., "arguments" | "parameters": {...}} object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters" if args_key == "arguments" else "arguments", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_calls(texts, args_key: str = "arguments") -> list[ParsedCall] | None:
    calls = []
    for t in texts:
        try:
            c = _call(json.loads(t), args_key)
        except ValueError:
            return None
        if c is None:
            return None
        calls.append(c)
    return calls


class Parser:
    """One format. `anywhere`: its section may start after content (else only at the output's start)."""

    name = ""
    markers: tuple[str, ...] = ()  # strings that open the tool-call section
    anywhere = True

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def section_start(self, text: str, since: int = 0) -> int | None:
        """Where the tool-call section begins in text, or None (not yet / never). `since`: text
        before it was searched already (a stream passes how far it had looked, so each character
        is searched a bounded number of times, not once per delta)."""
        if self.anywhere:
            at = max(0, since - max(map(len, self.markers)) + 1)
            found = [i for i in (text.find(m, at) for m in self.markers) if i >= 0]
            return min(found) if found else None
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.markers) else None

    # formats whose calls are delimited one by one (hermes): each call object lies between these;
    # None (the default): calls are known only when the output ends
    call_open: str | None = None
    call_close: str | None = None


class Hermes(Parser):
    name, markers = "hermes", ("<tool_call>",)
    call_open, call_close = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text):
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = _json_calls(a if a else b for a, b in self._CALL.findall(text))
        if not calls:
            return text, []
        return text[:start] or None, calls


class Llama3Json(Parser):
    name, markers, anywhere = "llama3_json", ("<|python_tag|>", "{"), False

    def extract(self, text):
        body = text.strip()
        body = body[len("<|python_tag|>"):].lstrip() if body.startswith("<|python_tag|>") else body
        if not body.startswith("{"):
            return text, []
        decoder, objs, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                objs.append(obj)
                i = _skip(body, i, ";")
        except ValueError:
            return text, []
        calls = [_call(o, "parameters") for o in objs]
        return (None, calls) if calls and all(calls) else (text, [])


def _skip(s: str, i: int, sep: str) -> int:
    """Past whitespace, at most one separator, and whitespace again."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i < len(s) and s[i] == sep:
        i += 1
    while i < len(s) and s[i].isspace():
        i += 1
    return i


class Mistral(Parser):
    name, markers = "mistral", ("[TOOL_CALLS]",)

    def extract(self, text):
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        parts = [p.strip() for p in text[start:].split("[TOOL_CALLS]") if p.strip()]
        if len(parts) == 1 and parts[0].startswith("["):
            try:
                objs = json.loads(parts[0])
            except ValueError:
                objs = None
            calls = [_call(o) for o in objs] if isinstance(objs, list) else []
        else:  # name[ARGS]{...} (or name{...}) per call
            calls = [self._named(p) for p in parts]
        if not calls or not all(calls):
            return text, []
        return text[:start] or None, calls

    @staticmethod
    def _named(part: str) -> ParsedCall | None:
        # possessive (Python 3.11): a run of whitespace is never split between the two \s* (no backtracking)
        m = re.match(r"([A-Za-z0-9_.-]++)\s*+(?:\[ARGS\])?+\s*+(\{.*\})\s*\Z", part, re.DOTALL)
        if not m:
            return None
        try:
            json.loads(m.group(2))
        except ValueError:
            return None
        return ParsedCall(m.group(1), m.group(2))


class Pythonic(Parser):
    name, markers, anywhere = "pythonic", ("[", "<|python_start|>"), False

    def extract(self, text):
        body = text.strip()
        if body.startswith("<|python_start|>"):
            body = body[len("<|python_start|>"):].removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            return None, [self._call(c) for c in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return text, []

    @staticmethod
    def _call(node) -> ParsedCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            raise ValueError("**kwargs")
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, Parser] = {p.name: p for p in (Hermes(), Llama3Json(), Mistral(), Pythonic())}
