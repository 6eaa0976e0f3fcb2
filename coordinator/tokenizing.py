"""Tokenizing requests off the coordinator's event loop.

Lifecycle: the coordinator makes one `OffLoopTokenizer` at start and closes it at shutdown. A
request whose prompt or messages need tokenizing is checked against the request limits first
(wire/limits.py: bytes before tokenizing), then `submit`ted: it runs on one of two worker
threads, one for prompts under SMALL_BYTES and one for larger ones, so a megabyte of text never
delays a short prompt; the fast tokenizer releases the GIL while it encodes, so the loop keeps
streaming. The result (token ids, or the exception) is handed back to the loop with
`call_soon_threadsafe`; the coordinator decides there whether the request still exists (its
client may have aborted or gone meanwhile). `tokenize` itself is a plain function, run inline
for token ids.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from runtime.errors import InvalidRequestError
from runtime.tokenizer import render_chat
from wire.protocol import GenerateRequest

SMALL_BYTES = 64 * 1024  # prompts up to this size share one thread; larger ones queue on the other


def tokenize(tok, req: GenerateRequest) -> list[int]:
    given = [x is not None for x in (req.prompt, req.messages, req.token_ids)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of prompt, messages, token_ids")
    if req.token_ids is not None:
        return list(req.token_ids)
    if req.messages is not None:
        return render_chat(tok, [{"role": m.role, "content": m.content} for m in req.messages])
    return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)


def prompt_texts(req: GenerateRequest) -> list[str]:
    """The text a request asks to tokenize: its prompt, or each message's role and content."""
    if req.prompt is not None:
        return [req.prompt]
    return [t for m in req.messages or () for t in (m.role, m.content)]


class OffLoopTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.small = ThreadPoolExecutor(1, thread_name_prefix="tokenize-small")
        self.large = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")

    def submit(self, req: GenerateRequest, nbytes: int, on_done) -> None:
        """Tokenize req on a thread; on_done(future) runs on the calling event loop."""
        loop = asyncio.get_running_loop()
        lane = self.small if nbytes <= SMALL_BYTES else self.large
        fut: Future = lane.submit(tokenize, self.tok, req)
        fut.add_done_callback(lambda f: _call_soon(loop, on_done, f))

    def close(self) -> None:
        for lane in (self.small, self.large):
            lane.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop closed at shutdown: nobody waits for this request any more
        pass
