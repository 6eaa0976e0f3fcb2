"""OpenAI response objects from coordinator results: whole responses and stream chunks.

Lifecycle: one formatter per HTTP request (its id, creation time and model name are shared by
every chunk). Streaming calls `opening()` once, `chunk(index, delta)` per coordinator delta (the
last delta of a choice carries its finish reason) and `usage_chunk()` when asked for; a whole
response comes from `whole(jobs, results)`. Token strings for logprobs come from `TokenText`,
which decodes each token id alone (as vLLM does) and remembers the answer; `fill()`, at the
gateway's start, decodes the whole vocabulary in one call of the Rust tokenizer (~70 ms for 49k
ids), so a response of many distinct ids (prompt_logprobs 20 on a long prompt: ~40k) holds the
loop for lookups only (it held it ~100-380 ms decoding them one by one).
"""
from __future__ import annotations

import msgspec

from pdserve.gateway.reasoning import ThinkParser
from pdserve.gateway.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    Job,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pdserve.gateway.scoring import Echo, echo_text, prompt_logprobs_field, prompt_logprobs_part
from pdserve.gateway.tools import CallStream, ToolPlan, whole_calls
from pdserve_client.library import Result, StreamDelta


class TokenText:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def fill(self) -> None:
        """Every id's text at once (the fast tokenizer's batch decode, equal to decoding each id alone); nothing without one."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            ids = range(len(self.tok))
            self.cache.update(zip(ids, backend.decode_batch([[i] for i in ids], skip_special_tokens=False)))

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
    """echo (gateway/scoring.py): each choice's first chunk (or its whole text) starts with the
    prompt, and, with logprobs, its logprobs with the prompt's; max_tokens 0 drops the one
    token sampled (finish_reason "length", no completion tokens)."""

    def __init__(self, rid: str, created: int, model: str, text: TokenText, echo: Echo = Echo(), jobs: list[Job] = ()):
        super().__init__(rid, created, model, text)
        self.offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self.echo = echo
        self.inputs = {j.index: j.inputs for j in jobs}  # what each choice echoes
        self.k = next((j.sampling.get("logprobs") for j in jobs), None)  # completions logprobs: top alternatives per token
        self.opened: set[int] = set()  # choices whose first chunk went out
        self.fields: dict[int, tuple[list, list]] = {}  # id(scores) -> (scores, held so the id stays theirs; vLLM's field of them)

    def _offsets(self, index: int, tokens: list[str]) -> list[int]:
        offsets = []
        at = self.offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self.offsets[index] = at
        return offsets

    def logprobs(self, index: int, token_ids: list[int], logprobs: list[float] | None, top: list | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        tokens = [self.text(t) for t in token_ids]
        tops = [{self.text(t): lp for t, lp in alts} for alts in (top or [[] for _ in token_ids])]
        return CompletionLogprobs(tokens, list(logprobs), tops, self._offsets(index, tokens))

    def prompt_part(self, index: int, ids: list[int] | None, scores: list | None) -> tuple[str, CompletionLogprobs | None, list | None]:
        """What choice `index` starts with: the echoed prompt and its logprobs, and vLLM's prompt_logprobs field."""
        e = self.echo
        field = self.prompt_field(ids, scores) if e.prompt_k is not None and scores is not None else None
        if not e.echo:
            return "", None, field
        lp = None
        if self.k is not None and scores is not None:
            tokens, lps, tops = prompt_logprobs_part(ids, scores, self.k, self.text)
            lp = CompletionLogprobs(tokens, lps, tops, self._offsets(index, tokens))
        return echo_text(self.inputs[index], self.text.tok), lp, field

    def prompt_field(self, ids: list[int], scores: list) -> list:
        """vLLM's prompt_logprobs field of these scores; the choices that share one prompt's scores
        (gateway/scoring.py) share the one field built for them."""
        if id(scores) not in self.fields:
            self.fields[id(scores)] = (scores, prompt_logprobs_field(ids, scores, self.echo.prompt_k, self.text))
        return self.fields[id(scores)][1]

    def choice(self, index: int, head: tuple, text: str, token_ids, logprobs, top, finish_reason) -> CompletionChoice:
        """A choice (or a chunk's) after its prompt part `head`; the output is dropped for max_tokens 0."""
        echoed, head_lp, field = head
        if self.echo.drop_output:
            text, token_ids, finish_reason = "", [], finish_reason and "length"
        lp = self.logprobs(index, token_ids, logprobs, top) if token_ids else None
        if head_lp is not None and lp is not None:
            lp = CompletionLogprobs(*(a + b for a, b in zip(msgspec.structs.astuple(head_lp), msgspec.structs.astuple(lp))))
        return CompletionChoice(index, echoed + text, lp or head_lp, finish_reason, field)

    def chunk(self, index: int, d: StreamDelta) -> CompletionResponse:
        head = ("", None, None)
        if index not in self.opened:
            self.opened.add(index)
            head = self.prompt_part(index, d.prompt_token_ids, d.prompt_logprobs)
        choice = self.choice(index, head, d.text, d.token_ids, d.logprobs, d.top_logprobs, d.finish_reason)
        return CompletionResponse(self.id, self.created, self.model, [choice])

    def usage_chunk(self, u: Usage) -> CompletionResponse:
        return CompletionResponse(self.id, self.created, self.model, [], self.usage(u))

    def usage(self, u: Usage) -> Usage:
        return Usage(u.prompt_tokens, 0, u.prompt_tokens) if self.echo.drop_output else u

    def whole(self, jobs: list[Job], results: list[Result]) -> CompletionResponse:
        choices = []
        for j, r in zip(jobs, results):
            head = self.prompt_part(j.index, r.prompt_token_ids, r.prompt_logprobs)
            lp = (r.logprobs, r.top_logprobs) if _asked(j) else (None, None)
            choices.append(self.choice(j.index, head, r.text, r.token_ids, *lp, r.finish_reason))
        return CompletionResponse(self.id, self.created, self.model, sorted(choices, key=lambda c: c.index), self.usage(usage(jobs, results)))


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
