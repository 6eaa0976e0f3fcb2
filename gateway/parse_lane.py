"""Large request bodies are scanned, decoded and bounded in a child process, so a costly body never
holds the gateway's event loop and never queues in front of a short request.

Why a process: msgspec holds the GIL for a whole decode (tens of milliseconds for the hostile
corpus's largest bodies), and a thread holding the GIL stalls the loop that streams every other
request (docs/performance.md, "Figures behind design choices").

Lifecycle: the gateway makes one `ParseLane`, starts its child as it starts (`start_early`: the
child's imports, ~0.4 s, were the first large body's wait, and 1.7 s under load) and closes it at
shutdown; the child is `python -m gateway.parse_lane LIMITS_JSON`, which lowers its own CPU priority.
`prepare(body, kind, limits)` is the one function that turns a body into its request Struct: the
scan for what is certainly over the bounds (refuse_oversized), the decode, and the checks of every
field of that kind against the table of bounds; small bodies run it inline on the loop, larger
ones (`parse`) in the child, one at a time in arrival order on one thread of the gateway (its pipe
reads and writes release the GIL); at most `max_queued` large bodies wait or run there (each
also holds its bytes in the gateway's body budget: gateway/bodies.py), one more is a 503
(parser_busy, with Retry-After). A body nested too deep for the decoder's recursion is a 400
(gateway/schema.py's too_deep), inline and in the child alike. The child answers the Struct
re-encoded as msgpack (decoding it costs a fraction of the JSON, and it is bounded by then) or
the ApiError it raised. A request cancelled while it waits (its client gone) is never sent; a
child that dies is restarted and the body it held is answered 503.
"""
from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pdserve.gateway.errors import ApiError
from pdserve.gateway.responses import ResponsesRequest, responses_bounds
from pdserve.gateway.schema import ChatCompletionRequest, CompletionRequest, bounded, chat_bounds, decode_body, refuse_oversized, request_bounds
from pdserve.gateway.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from pdserve.wire.limits import RequestLimits

INLINE_BYTES = 256 * 1024  # a larger body is prepared in the child
PIECE_IDS = 65536  # a completions body's prompts come back in pieces of about this many token ids (~2 ms to decode each)
NICE = 10  # the child's CPU priority below the serving processes'
KINDS = {k.__name__: k for k in (CompletionRequest, ChatCompletionRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                 DetokenizeRequest, ResponsesRequest)}
TOKENIZE = "tokenize"  # /tokenize: a chat body if it has "messages", else a completion body


class _Job(msgspec.Struct, array_like=True):
    kind: str
    body: bytes


class _Reply(msgspec.Struct, array_like=True):
    kind: str = ""  # the Struct's class name (TOKENIZE resolves to one of its two)
    data: bytes = b""  # the Struct, msgpack
    status: int = 0  # an ApiError: its status, message, code and param
    message: str = ""
    code: str | None = None
    param: str | None = None
    pieces: list[bytes] = []  # a CompletionRequest's list of prompts, taken out of data (split_prompts)


class _Keys(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")


def _is_chat(body: bytes) -> bool:
    try:
        return len(msgspec.json.decode(body, type=_Keys).messages) > 0
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False  # refuse_oversized or decode_body then reports the bad JSON


def prepare(body: bytes, kind: str, limits: RequestLimits):
    """The body as the Struct `kind` names (TOKENIZE: the chat or the completion shape), every
    field within the bounds; an ApiError (400 naming the field) otherwise."""
    if kind == TOKENIZE:
        kind = TokenizeChatRequest.__name__ if _is_chat(body) else TokenizeCompletionRequest.__name__
    refuse_oversized(body, limits)
    req = decode_body(body, KINDS[kind])
    if isinstance(req, (CompletionRequest, ChatCompletionRequest)):
        request_bounds(req, limits)
    elif isinstance(req, ResponsesRequest):
        responses_bounds(req, limits)
    elif isinstance(req, TokenizeChatRequest):
        bounded(chat_bounds, req.messages, limits, req.tools)
        bounded(limits.check_template_kwargs, req.chat_template_kwargs)
    elif isinstance(req, TokenizeCompletionRequest):
        bounded(limits.check_prompt_bytes, [req.prompt])
    else:
        bounded(limits.check_token_ids, len(req.tokens), "tokens")
    return req


class ParseLane:
    def __init__(self, limits: RequestLimits, max_queued: int = 32, retry_after_s: int = 1):
        self.limits = limits
        self.max_queued = max_queued  # large bodies queued for the child or in it; one more is a 503 (GatewayConfig.parse_queue)
        self.retry_after_s = retry_after_s
        self.queued = 0
        self.proc: subprocess.Popen | None = None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="parse-lane")  # one body at a time, in order
        self.lock = threading.Lock()  # the child's pipes: the lane's thread, and close()
        self.starts = 0  # the child is started at the gateway's start (start_early), again by the next large body after it died

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "pdserve.gateway.parse_lane", msgspec.json.encode(self.limits).decode()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def start_early(self) -> None:
        """Start the child now, from the lane's thread (which holds the pipes), not on the first large body."""
        def start() -> None:
            with self.lock:
                self._start_if_down()

        self.thread.submit(start)

    def _start_if_down(self) -> None:
        """(Under self.lock.) Start the child unless it runs."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    async def parse(self, body: bytes, kind: str):
        """prepare(body, kind) in the child; cancelling the caller while it waits drops the body."""
        if len(body) <= INLINE_BYTES:
            return prepare(body, kind, self.limits)
        if self.queued >= self.max_queued:
            raise ApiError(503, f"the gateway's request parser has {self.queued} large bodies queued; retry", "parser_busy",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.queued += 1
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self.thread, self._round_trip, _Job(kind, body))
        finally:
            self.queued -= 1
        if reply.status:
            raise ApiError(reply.status, reply.message, reply.code, reply.param)
        req = msgspec.msgpack.decode(reply.data, type=KINDS[reply.kind])
        if reply.pieces:  # 8 prompts of 131,072 ids took 32 ms to decode at once: a piece at a time, other streams between
            req.prompt = []
            for piece in reply.pieces:
                await asyncio.sleep(0)
                req.prompt += msgspec.msgpack.decode(piece)
        return req

    def _round_trip(self, job: _Job) -> _Reply:
        with self.lock:
            try:
                self._start_if_down()
                _write(self.proc.stdin, msgspec.msgpack.encode(job))
                return msgspec.msgpack.decode(_read(self.proc.stdout), type=_Reply)
            except (OSError, EOFError, msgspec.DecodeError):
                self._stop()
                return _Reply(status=503, message="the gateway's request parser restarted; retry", code="parser_restarted")

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self._stop()


def _write(f, data: bytes) -> None:
    f.write(struct.pack("<I", len(data)))
    f.write(data)
    f.flush()


def _read(f) -> bytes:
    head = f.read(4)
    if len(head) < 4:
        raise EOFError("the parser closed its pipe")
    (n,) = struct.unpack("<I", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the parser closed its pipe")
    return data


def split_prompts(req) -> list[bytes]:
    """A completions request's list of prompts (up to 1,048,576 token ids in all), taken out of req
    and encoded in pieces of whole prompts, each about PIECE_IDS ids, so that the gateway decodes
    them a piece at a time (ParseLane.parse); [] for any other request, left whole."""
    if not (isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (list, str))):
        return []
    pieces, start, size = [], 0, 0
    for i, p in enumerate(req.prompt):
        size += len(p) if isinstance(p, list) else 1
        if size >= PIECE_IDS or i == len(req.prompt) - 1:
            pieces.append(msgspec.msgpack.encode(req.prompt[start:i + 1]))
            start, size = i + 1, 0
    req.prompt = []
    return pieces


def main() -> None:
    """The child: read jobs on stdin, answer each on stdout, until stdin closes."""
    os.nice(NICE)
    limits = msgspec.json.decode(sys.argv[1], type=RequestLimits)
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            job = msgspec.msgpack.decode(_read(src), type=_Job)
        except EOFError:
            return
        try:
            req = prepare(job.body, job.kind, limits)
            pieces = split_prompts(req)
            reply = _Reply(type(req).__name__, msgspec.msgpack.encode(req), pieces=pieces)
        except ApiError as e:
            reply = _Reply(status=e.status, message=e.message, code=e.code, param=e.param)
        except Exception as e:  # a bug here must answer this body, not take the lane down
            reply = _Reply(status=500, message=f"internal error preparing the request: {type(e).__name__}", code="internal_error")
        _write(dst, msgspec.msgpack.encode(reply))


if __name__ == "__main__":
    main()
