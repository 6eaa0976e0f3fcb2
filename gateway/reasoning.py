"""Reasoning parsers (`--reasoning-parser`, vLLM's names `deepseek_r1` and `qwen3`): a model's
`<think>...</think>` block goes to `reasoning_content`, the rest to `content`.

Both follow vLLM's current parsers: a `<think>` the model writes itself is dropped (newer chat
templates put it in the prompt), the text before `</think>` is reasoning and the text after it
content; an output without `</think>` is reasoning only (it was cut short). vLLM matches the
tags as single tokens of those models' vocabularies; here they are matched in the text, which
is the same for those models and lets any tokenizer be served.

Qwen3's switch: a chat whose chat_template_kwargs say `enable_thinking: false` gets Qwen3's
template's empty `<think>\n\n</think>\n\n` block in its prompt and answers without reasoning,
so `qwen3` splits nothing for it: the whole output is content, blocking and streamed alike (as
SGLang's qwen3 parser does; vLLM's reaches the same for whole outputs, which hold no
`</think>`), and a structured output's grammar holds from the first token. `deepseek_r1` has no
switch.

Lifecycle: `REASONING_PARSERS[name]` is stateless; `for_request(chat_template_kwargs)` is the
parser a request's output goes through (None: no split). `split(text)` for a whole output; a
stream makes one `ReasoningStream` per choice and feeds it each text delta (`feed` ->
(reasoning, content) pieces), then `flush()`es what it held back when the choice ends. Held
back: only a tail that may be the start of a tag.
"""
from __future__ import annotations

from dataclasses import dataclass


def held_back(text: str, tags) -> int:
    """How many characters at the end of text may be the start of one of the tags."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


@dataclass(frozen=True)
class ThinkParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    switch: str | None = None  # the chat_template_kwargs key whose false turns reasoning off (Qwen3's enable_thinking)

    def for_request(self, template_kwargs: dict | None) -> ThinkParser | None:
        """This parser, or None where the request's template variables turned the model's reasoning off."""
        if self.switch is not None and (template_kwargs or {}).get(self.switch) is False:
            return None
        return self

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        before, tag, after = text.partition(self.start)
        text = after if tag else before
        reasoning, tag, content = text.partition(self.end)
        if not tag:
            return text or None, None
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    def __init__(self, parser: ThinkParser):
        self.p = parser
        self.pending = ""  # text not yet handed out (a possible tag's start)
        self.done = False  # </think> seen: the rest is content
        self.started = False  # past a leading <think> (or sure there is none)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) this delta adds; either may be ""."""
        if self.done:
            return "", delta
        text = self.pending + delta
        if not self.started:
            i = text.find(self.p.start)
            if i >= 0:
                text, self.started = text[:i] + text[i + len(self.p.start):], True
        end = text.find(self.p.end)
        if end >= 0:
            self.done, self.pending = True, ""
            return text[:end], text[end + len(self.p.end):]
        keep = held_back(text, (self.p.end,) if self.started else (self.p.end, self.p.start))
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        out, self.pending = self.pending, ""
        return ("", out) if self.done else (out, "")


REASONING_PARSERS = {"deepseek_r1": ThinkParser("deepseek_r1"), "qwen3": ThinkParser("qwen3", switch="enable_thinking")}
