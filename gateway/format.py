"""OpenAI response objects from coordinator results: whole responses and stream chunks.

Lifecycle: one formatter per HTTP request (its id, creation time and model name are shared by
every chunk). Streaming calls `opening()` once, `chunk(index, delta)` per coordinator delta (the
last delta of a choice carries its finish reason) and `usage_chunk()` when asked for; a whole
response comes from `whole(jobs, results)`. Token strings for logprobs come from `TokenText`,
which decodes each token id alone (as vLLM does) and remembers the answer.
"""
from __future__ import annotations

from client.library import Result, StreamDelta
from gateway.reasoning import ThinkParser
from gateway.tools import CallStream, ToolPlan, whole_calls
from gateway.schema import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
    CompletionLogprobs, CompletionResponse, DeltaMessage, Job, TokenLogprob, TopLogprob, Usage,
)


class TokenText:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return s


def usage(jobs: list[Job], results: list[Result]) -> Usage:
    """A prompt sampled n times counts its tokens once (as OpenAI and vLLM count them)."""
    prompt = {j.prompt_index: r.prompt_tokens for j, r in zip(jobs, results)}
    completion = sum(r.completion_tokens for r in results)
    return Usage(sum(prompt.values()), completion, sum(prompt.values()) + completion)


class _Formatter:
    def __init__(self, rid: str, created: int, model: str, text: TokenText):
        self.id, self.created, self.model, self.text = rid, created, model, text

    def opening(self, indices: list[int]) -> list:
        return []

    def chunks(self, index: int, d: StreamDelta) -> list:
        """The stream chunks one coordinator delta makes (a chat's tool calls may make several)."""
        return [self.chunk(index, d)]


class CompletionFormatter(_Formatter):
    def __init__(self, rid: str, created: int, model: str, text: TokenText):
        super().__init__(rid, created, model, text)
        self.offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def logprobs(self, index: int, token_ids: list[int], logprobs: list[float] | None, top: list | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self.text(t) for t in token_ids]
        offsets = []
        at = self.offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self.offsets[index] = at
        tops = [{self.text(t): lp for t, lp in alts} for alts in (top or [[] for _ in token_ids])]
        return CompletionLogprobs(tokens, list(logprobs), tops, offsets)

    def chunk(self, index: int, d: StreamDelta) -> CompletionResponse:
        lp = self.logprobs(index, d.token_ids, d.logprobs, d.top_logprobs) if d.token_ids else None
        return CompletionResponse(self.id, self.created, self.model, [CompletionChoice(index, d.text, lp, d.finish_reason)])

    def usage_chunk(self, u: Usage) -> CompletionResponse:
        return CompletionResponse(self.id, self.created, self.model, [], u)

    def whole(self, jobs: list[Job], results: list[Result]) -> CompletionResponse:
        choices = []
        for j, r in zip(jobs, results):
            lp = self.logprobs(j.index, r.token_ids, r.logprobs, r.top_logprobs) if _asked(j) else None
            choices.append(CompletionChoice(j.index, r.text, lp, r.finish_reason))
        return CompletionResponse(self.id, self.created, self.model, sorted(choices, key=lambda c: c.index), usage(jobs, results))


class ChatFormatter(_Formatter):
    """plan: how the request's tools shape the answer (gateway/tools.py; None: no tools);
    reasoning: the server's --reasoning-parser (gateway/reasoning.py), or None."""

    def __init__(self, rid: str, created: int, model: str, text: TokenText, plan: ToolPlan | None = None,
                 reasoning: ThinkParser | None = None):
        super().__init__(rid, created, model, text)
        self.plan, self.reasoning = plan, reasoning
        self.parts: dict[int, tuple] = {}  # choice index -> (its ReasoningStream | None, its CallStream | None)

    def logprobs(self, token_ids: list[int], logprobs: list[float] | None, top: list | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for t, lp, alts in zip(token_ids, logprobs, top or [[] for _ in token_ids]):
            s = self.text(t)
            content.append(TokenLogprob(s, lp, list(s.encode()), [TopLogprob(self.text(a), alp, list(self.text(a).encode())) for a, alp in alts]))
        return ChatLogprobs(content)

    def opening(self, indices: list[int]) -> list[ChatCompletionChunk]:
        """OpenAI's first chunk of each choice names the role and carries no text."""
        return [ChatCompletionChunk(self.id, self.created, self.model, [ChatChunkChoice(i, DeltaMessage("assistant", ""))]) for i in indices]

    def chunk(self, index: int, d: StreamDelta) -> ChatCompletionChunk:
        lp = self.logprobs(d.token_ids, d.logprobs, d.top_logprobs) if d.token_ids else None
        delta = DeltaMessage(content=d.text) if d.text or not d.finish_reason else DeltaMessage()
        return ChatCompletionChunk(self.id, self.created, self.model, [ChatChunkChoice(index, delta, lp, d.finish_reason)])

    def chunks(self, index: int, d: StreamDelta) -> list[ChatCompletionChunk]:
        if self.plan is None and self.reasoning is None:
            return [self.chunk(index, d)]
        reasoning, content, calls = self._split(index, d.text, d.finish_reason is not None)
        deltas = ([DeltaMessage(reasoning_content=reasoning)] if reasoning else []) + ([DeltaMessage(content=content)] if content else [])
        deltas += [DeltaMessage(tool_calls=[c]) for c in calls]
        if not deltas:
            deltas = [DeltaMessage() if d.finish_reason else DeltaMessage(content="")]
        lp = self.logprobs(d.token_ids, d.logprobs, d.top_logprobs) if d.token_ids else None
        reason = _tool_finish(d.finish_reason, self.parts[index][1])
        last = len(deltas) - 1
        return [ChatCompletionChunk(self.id, self.created, self.model,
                                    [ChatChunkChoice(index, delta, lp if i == 0 else None, reason if i == last else None)])
                for i, delta in enumerate(deltas)]

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str, list]:
        """A delta's text -> (reasoning, content, tool-call deltas); final: the choice ends here."""
        if index not in self.parts:
            self.parts[index] = (self.reasoning.stream() if self.reasoning else None, CallStream(self.plan) if self.plan else None)
        think, calls = self.parts[index]
        reasoning, content = think.feed(text) if think else ("", text)
        if final and think:
            r, c = think.flush()
            reasoning, content = reasoning + r, content + c
        if calls is None:
            return reasoning, content, []
        content, made = calls.feed(content)
        if final:
            c, more = calls.finish()
            content, made = content + c, made + more
        return reasoning, content, made

    def usage_chunk(self, u: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [], u)

    def message(self, r: Result) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason."""
        if self.plan is None and self.reasoning is None:
            return AssistantMessage(r.text), r.finish_reason
        reasoning, content = self.reasoning.split(r.text) if self.reasoning else (None, r.text)
        calls = []
        if self.plan is not None and content is not None:  # None: all of it was reasoning
            content, calls = whole_calls(self.plan, content)
        reason = "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason
        return AssistantMessage(content, tool_calls=calls or None, reasoning_content=reasoning), reason

    def whole(self, jobs: list[Job], results: list[Result]) -> ChatCompletionResponse:
        choices = []
        for j, r in zip(jobs, results):
            lp = self.logprobs(r.token_ids, r.logprobs, r.top_logprobs) if _asked(j) else None
            message, reason = self.message(r)
            choices.append(ChatChoice(j.index, message, lp, reason))
        return ChatCompletionResponse(self.id, self.created, self.model, sorted(choices, key=lambda c: c.index), usage(jobs, results))


def _tool_finish(reason: str | None, calls: CallStream | None) -> str | None:
    """A choice that made tool calls and stopped by itself ends with "tool_calls", as OpenAI's do."""
    return "tool_calls" if reason == "stop" and calls is not None and calls.calls else reason


def _asked(job: Job) -> bool:
    return job.sampling.get("logprobs") is not None
