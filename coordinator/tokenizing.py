"""Tokenizing requests off the coordinator's event loop, never for a request that is gone, and
once for identical inputs.

Lifecycle: the coordinator makes one `OffLoopTokenizer` at start and closes it at shutdown
(queued work is cancelled). A request whose prompt or messages need tokenizing is checked
against the table of bounds first (wire/limits.py: its cost, the bytes plus a fixed overhead per
message, before tokenizing), then `submit`ted with that cost and gets a `Ticket`. Its work runs
on one of two worker threads, one for costs up to SMALL_COST and one for larger ones, so a
megabyte of text or thousands of messages never delay a short prompt; the fast tokenizer
releases the GIL while it encodes, so the loop keeps streaming. Inputs identical to work queued
or running (the n choices of one chat send the same messages n times) join that work instead of
rendering the template again. When the work ends, every ticket still waiting gets `on_done(future)`
on the loop (token ids, or the exception); `cancel(ticket)` (the request aborted, its client
gone) drops the ticket, and once no ticket waits for queued work the work is cancelled and never
runs. All bookkeeping happens on the loop's thread. `tokenize` itself is a plain function, run
inline for token ids.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from pdserve.common.tokenizer import render_chat, template_message
from pdserve_client.errors import InvalidRequestError
from pdserve_client.protocol import GenerateRequest

SMALL_COST = 64 * 1024  # bytes (message overhead included) up to which requests share one thread; costlier ones queue on the other


def tokenize(tok, req: GenerateRequest) -> list[int]:
    given = [x is not None for x in (req.prompt, req.messages, req.token_ids)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of prompt, messages, token_ids")
    if req.token_ids is not None:
        return list(req.token_ids)
    if req.messages is not None:
        return render_chat(tok, [template_message(m) for m in req.messages], _tools(req.tools), req.chat_template_kwargs)
    return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)


def _tools(text: str | None) -> list | None:
    if text is None:
        return None
    try:
        tools = json.loads(text)
    except ValueError:
        raise InvalidRequestError("tools is not a JSON list") from None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools is not a JSON list")
    return tools


def prompt_texts(req: GenerateRequest) -> list[str]:
    """The text a request asks to tokenize: its prompt, or each message's role, content and
    calls, its tools and its template variables' text (all may be rendered into the prompt)."""
    if req.prompt is not None:
        return [req.prompt]
    texts = [t for m in req.messages or () for t in (m.role, m.content, m.tool_call_id or "", m.name or "")]
    texts += [t for m in req.messages or () for c in m.tool_calls or () for t in (c.id, c.name, c.arguments)]
    texts += [v for v in (req.chat_template_kwargs or {}).values() if isinstance(v, str)]
    return texts + [req.tools or ""]


def inputs_key(req: GenerateRequest) -> tuple:
    """What the token ids depend on (a chat's template kwargs too): equal keys tokenize to equal ids."""
    if req.messages is not None:
        kwargs = tuple(sorted((req.chat_template_kwargs or {}).items()))
        return ("chat", tuple(msgspec.msgpack.encode(m) for m in req.messages), req.tools, msgspec.msgpack.encode(kwargs))
    return ("prompt", req.prompt, req.add_special_tokens)


@dataclass(eq=False)
class _Work:
    key: tuple
    future: Future
    tickets: set = field(default_factory=set)


@dataclass(eq=False)
class Ticket:
    """One request's wait for its tokens."""

    work: _Work
    on_done: object  # on_done(future), on the loop


class OffLoopTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.small = ThreadPoolExecutor(1, thread_name_prefix="tokenize-small")
        self.large = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")
        self.work: dict[tuple, _Work] = {}  # inputs -> its queued or running work
        self.shared = 0  # submissions that joined identical work (stats)
        self.cancelled = 0  # works cancelled before they ran

    def submit(self, req: GenerateRequest, cost: int, on_done) -> Ticket:
        """Tokenize req on a thread (or join identical work); on_done(future) runs on the calling
        event loop unless the ticket is cancelled first. cost: bytes plus message overhead."""
        key = inputs_key(req)
        work = self.work.get(key)
        if work is None:
            lane = self.small if cost <= SMALL_COST else self.large
            work = _Work(key, lane.submit(tokenize, self.tok, req))
            self.work[key] = work
            loop = asyncio.get_running_loop()
            work.future.add_done_callback(lambda f: _call_soon(loop, self._finished, work))
        else:
            self.shared += 1
        ticket = Ticket(work, on_done)
        work.tickets.add(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The request is gone: its on_done never runs; work nobody else waits for is cancelled
        if it has not started (running work finishes, and identical inputs may still join it)."""
        work = ticket.work
        work.tickets.discard(ticket)
        if not work.tickets and work.future.cancel():
            self.cancelled += 1
            self._forget(work)

    def _finished(self, work: _Work) -> None:
        self._forget(work)
        for ticket in list(work.tickets):
            ticket.on_done(work.future)
        work.tickets.clear()

    def _forget(self, work: _Work) -> None:
        if self.work.get(work.key) is work:
            del self.work[work.key]

    def close(self) -> None:
        for lane in (self.small, self.large):
            lane.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop closed at shutdown: nobody waits for this request any more
        pass
