"""Client library: `Client` (blocking) and `AsyncClient` (asyncio) for the coordinator.

Lifecycle: a client opens one DEALER to the coordinator's client port. `generate()` sends a
GenerateRequest and collects Delta messages until Final (returning a `Result`) or ErrorReply
(raising the matching typed `RequestError`); `stream()` yields each delta as it arrives and
aborts the request on the coordinator if the caller stops early or the timeout passes.
`Client` is for one thread; `AsyncClient` multiplexes any number of concurrent requests over
its socket with one reader task. Both are closed with `close()` (or as context managers).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pdserve_client.keys import client_options, launch_keys_for, loopback_port
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import (
    MAX_CONTROL_MESSAGE,
    AbortRequest,
    ChatMessage,
    CoordinatorToClient,
    Delta,
    ErrorReply,
    Final,
    GenerateRequest,
    StatsReply,
    StatsRequest,
    StatusRequest,
    decoder,
    encode,
)

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


class ClientError(Exception):
    code = "client_error"


class RequestTimeout(ClientError):
    code = "timeout"


class CoordinatorUnreachable(ClientError):
    """No connection to the coordinator could take the message (down, or the keys are wrong)."""

    code = "unreachable"


def _send_now(sock, data: bytes):
    """Send without blocking: a DEALER with no live connection would otherwise wait forever.
    On an asyncio socket the send is attempted at once too and its outcome comes back as a
    completed future, whose error is raised here (so none is left unretrieved)."""
    try:
        sent = sock.send(data, zmq.NOBLOCK)
        if sent is not None and sent.done() and sent.exception() is not None:
            raise sent.exception()
        return sent
    except zmq.Again:
        raise CoordinatorUnreachable("no connection to the coordinator (is it running? are the CurveZMQ keys right?)") from None


class RequestError(ClientError):
    """The coordinator or a worker refused or ended the request; `code` says why."""

    def __init__(self, code: str, message: str, retry_after_s: float = 0.0):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # > 0: when a retry can succeed (ErrorReply.retry_after_s)


class InvalidRequest(RequestError):
    pass


class PromptTooLong(InvalidRequest):
    pass


class NoWorkers(RequestError):
    pass


class Overloaded(RequestError):
    """Shed by the scheduler (overloaded, slo_unattainable): retry later."""


class WorkerLost(RequestError):
    pass


class RequestLost(RequestError):
    """The coordinator no longer knows the request (it restarted while the request ran)."""


class ClientTooSlow(RequestError):
    """This client left more than the coordinator's send budget unread, so its requests were aborted."""


_ERRORS = {
    "invalid_request": InvalidRequest, "invalid_sampling_params": InvalidRequest, "bad_message": InvalidRequest,
    "prompt_too_long": PromptTooLong, "limit_exceeded": InvalidRequest, "no_workers": NoWorkers, "cold_start": NoWorkers, "overloaded": Overloaded,
        "slo_unattainable": Overloaded,
    "worker_lost": WorkerLost, "kv_transfer_failed": WorkerLost, "kv_transfer_timeout": WorkerLost,
    "unknown_request": RequestLost, "client_too_slow": ClientTooSlow,
}
PROBE_S = 2.0  # silence after which a waiting client asks whether its request is still known


def request_error(reply: ErrorReply) -> RequestError:
    return _ERRORS.get(reply.code, RequestError)(reply.code, reply.message, reply.retry_after_s)


@dataclass
class Result:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0  # seconds, as seen by the coordinator
    token_times: list[float] = field(default_factory=list)  # seconds since arrival, per token
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    stop_text: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    client_ttft: float | None = None  # seconds, as seen by this client
    latency: float = 0.0  # seconds end to end, as seen by this client
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs asked: the prompt's ids
    prompt_logprobs: list | None = None  # and a (logprob, rank, [(id, logprob)] top) per id after the first

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def add(self, d: Delta, t0: float) -> None:
        if self.client_ttft is None and d.token_ids:
            self.client_ttft = time.monotonic() - t0
        if d.prompt_logprobs is not None:
            self.prompt_token_ids, self.prompt_logprobs = d.prompt_token_ids, d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        if d.top_logprobs:
            self.top_logprobs += d.top_logprobs

    def end(self, f: Final, t0: float) -> None:
        self.finish_reason = f.finish_reason.name.lower()
        self.prompt_tokens, self.completion_tokens = f.prompt_tokens, f.completion_tokens
        self.ttft, self.token_times, self.stop_text = f.ttft, f.token_times, f.stop_text
        self.prefill_worker, self.decode_worker = f.prefill_worker, f.decode_worker
        self.latency = time.monotonic() - t0


@dataclass
class StreamDelta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # set on the last delta
    result: Result | None = None  # the whole result, on the last delta
    top_logprobs: list | None = None  # per token: [(token_id, logprob), ...] when logprobs were asked for
    prompt_token_ids: list[int] | None = None  # once, before the first token, when prompt_logprobs were asked for
    prompt_logprobs: list | None = None  # per prompt token after the first: (logprob, rank, [(token_id, logprob), ...])


def encode_request(req: GenerateRequest) -> bytes:
    """The request's wire bytes. One over the coordinator's message limit would make it drop this
    connection, and every other stream on it, so it is refused here as invalid instead."""
    try:
        data = encode(req)
    except (OverflowError, UnicodeEncodeError) as e:  # an int past 64 bits, a lone surrogate: msgpack cannot carry them
        raise InvalidRequest("invalid_request", f"the request cannot be encoded: {e}") from None
    if len(data) > MAX_CONTROL_MESSAGE:
        raise InvalidRequest("invalid_request", f"the request encodes to {len(data)} bytes; the limit is {MAX_CONTROL_MESSAGE}")
    return data


def to_delta(msg, result: Result, t0: float) -> StreamDelta | None:
    """Fold one coordinator message for this request into `result`: a Delta or the closing
    Final becomes a StreamDelta (the last one carries the result); an ErrorReply raises."""
    if isinstance(msg, Delta):
        result.add(msg, t0)
        return StreamDelta(msg.text, msg.token_ids, msg.logprobs, top_logprobs=msg.top_logprobs, prompt_token_ids=msg.prompt_token_ids,
                           prompt_logprobs=msg.prompt_logprobs)
    if isinstance(msg, Final):
        result.end(msg, t0)
        return StreamDelta("", [], None, result.finish_reason, result)
    if isinstance(msg, ErrorReply):
        raise request_error(msg)
    return None


def build_request(prompt, messages, token_ids, sampling: dict, request_id: str | None = None, priority: int = 0,
                  ttft_ms: float = 0.0, tpot_ms: float = 0.0, trace_headers: dict | None = None, tools: str | None = None,
                  chat_template_kwargs: dict | None = None) -> GenerateRequest:
    """tools: a chat's tools as JSON text, for the chat template (the gateway's gateway/tools.py);
    chat_template_kwargs: further variables for the chat template (e.g. {"enable_thinking": False})."""
    try:
        params = SamplingParams(**sampling)
    except TypeError as e:
        raise InvalidRequest("invalid_request", str(e)) from None
    msgs = None if messages is None else [m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"]) for m in messages]
    return GenerateRequest(request_id or uuid.uuid4().hex, params, prompt, msgs, None if token_ids is None else list(token_ids),
                           priority=priority, ttft_ms=ttft_ms, tpot_ms=tpot_ms, trace_headers=trace_headers or None, tools=tools,
                           chat_template_kwargs=chat_template_kwargs or None)


def _socket(ctx, address: str, curve: dict | None, keys: str | None = None):
    if keys is not None:
        curve = {**client_options(keys), **(curve or {})}
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
    for opt, value in (curve or {}).items():
        sock.setsockopt(opt, value)
    sock.connect(address)
    return sock


class _Endpoint:
    """A client's socket to `address`: with the keys or curve options it was given, or, for a
    loopback address given neither, with the keys a running launch of this user made for it
    (keys.py launch_keys_for). Those are looked up again before each request (`renew`: a readlink
    and a kill(pid, 0)), and the socket made anew when they changed: a client made before its
    launch wrote them, or outliving it, finds the next one's."""

    def __init__(self, ctx, address: str, curve: dict | None, keys: str | None):
        self.ctx, self.address = ctx, address
        self.found = keys is None and curve is None and loopback_port(address) is not None
        self.keys = launch_keys_for(address) if self.found else keys
        self.sock = _socket(ctx, address, curve, self.keys)

    def renew(self, before=None) -> None:
        """Make the socket anew if the launch's keys changed (`before()` runs first: e.g. stop a reader of the old one)."""
        if not self.found or (keys := launch_keys_for(self.address)) == self.keys:
            return
        if before is not None:
            before()
        self.sock.close(linger=0)
        self.keys, self.sock = keys, _socket(self.ctx, self.address, None, keys)


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 120.0, curve: dict | None = None, keys: str | None = None):
        self.timeout = timeout
        self.ctx = zmq.Context()
        self.endpoint = _Endpoint(self.ctx, address, curve, keys)
        self.dec = decoder(CoordinatorToClient)

    @property
    def sock(self) -> zmq.Socket:
        return self.endpoint.sock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def _recv(self, deadline: float, request_id: str | None = None):
        """The next message; while a request waits, silence longer than PROBE_S sends a StatusRequest."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout("no answer from the coordinator in time")
            wait = min(left, PROBE_S) if request_id else left
            if self.sock.poll(int(wait * 1000)):
                return self.dec.decode(self.sock.recv())
            if request_id:
                _send_now(self.sock, encode(StatusRequest(request_id)))

    def stream(self, prompt=None, *, messages=None, token_ids=None, timeout=None, request_id=None, priority=0,
               ttft_ms=0.0, tpot_ms=0.0, trace_headers=None, tools=None, chat_template_kwargs=None, **sampling):
        req = build_request(prompt, messages, token_ids, sampling, request_id, priority, ttft_ms, tpot_ms, trace_headers, tools,
                            chat_template_kwargs)
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.timeout)
        result = Result(req.request_id)
        self.endpoint.renew()
        _send_now(self.sock, encode_request(req))
        done = False
        try:
            while True:
                msg = self._recv(deadline, req.request_id)
                if getattr(msg, "request_id", None) != req.request_id:
                    continue  # a late message of an earlier, abandoned request
                try:
                    delta = to_delta(msg, result, t0)
                except RequestError:
                    done = True  # the coordinator ended it: nothing to abort
                    raise
                done = delta is not None and delta.result is not None
                if delta is not None:
                    yield delta
                if done:
                    return
        finally:
            if not done:
                try:
                    self.abort(req.request_id)
                except CoordinatorUnreachable:
                    pass  # nothing to abort on a coordinator we cannot reach

    def generate(self, prompt=None, **kw) -> Result:
        last = None
        for last in self.stream(prompt, **kw):
            pass
        return last.result

    def abort(self, request_id: str) -> None:
        _send_now(self.sock, encode(AbortRequest(request_id)))

    def stats(self, timeout: float = 10.0) -> dict:
        self.endpoint.renew()
        _send_now(self.sock, encode(StatsRequest()))
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(deadline)
            if isinstance(msg, StatsReply):
                return msgspec.json.decode(msg.json)


class AsyncClient:
    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 120.0, curve: dict | None = None, keys: str | None = None):
        self.timeout = timeout
        self.ctx = zmq.asyncio.Context()
        self.endpoint = _Endpoint(self.ctx, address, curve, keys)
        self.dec = decoder(CoordinatorToClient)
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats_waiters: list[asyncio.Future] = []
        self._reader: asyncio.Task | None = None

    @property
    def sock(self) -> zmq.asyncio.Socket:
        return self.endpoint.sock

    def _renew(self) -> None:
        """Before a request: the launch's keys looked up again (_Endpoint); a new socket gets a new reader."""
        def stop_reader():
            if self._reader is not None:
                self._reader.cancel()
                self._reader = None
        self.endpoint.renew(stop_reader)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(linger=0)
        self.ctx.term()

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = self.dec.decode(await self.sock.recv())
            if isinstance(msg, StatsReply):
                while self.stats_waiters:
                    fut = self.stats_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msgspec.json.decode(msg.json))
                        break
                continue
            q = self.queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)

    async def stream(self, prompt=None, *, messages=None, token_ids=None, timeout=None, request_id=None, priority=0,
               ttft_ms=0.0, tpot_ms=0.0, trace_headers=None, tools=None, chat_template_kwargs=None, **sampling):
        req = build_request(prompt, messages, token_ids, sampling, request_id, priority, ttft_ms, tpot_ms, trace_headers, tools,
                            chat_template_kwargs)
        data = encode_request(req)
        self._renew()
        self._ensure_reader()
        q: asyncio.Queue = asyncio.Queue()
        self.queues[req.request_id] = q
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.timeout)
        result = Result(req.request_id)
        done = False
        await _send_now(self.sock, data)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout("no answer from the coordinator in time")
                try:
                    # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as
                    # q.get() completes (gh-86296), so a cancelled stream ran on and sent no abort
                    async with asyncio.timeout(min(left, PROBE_S)):
                        msg = await q.get()
                except TimeoutError:
                    await _send_now(self.sock, encode(StatusRequest(req.request_id)))
                    continue
                try:
                    delta = to_delta(msg, result, t0)
                except RequestError:
                    done = True  # the coordinator ended it: nothing to abort
                    raise
                done = delta is not None and delta.result is not None
                if delta is not None:
                    yield delta
                if done:
                    return
        finally:
            self.queues.pop(req.request_id, None)
            if not done:
                try:
                    _send_now(self.sock, encode(AbortRequest(req.request_id)))
                except (CoordinatorUnreachable, zmq.ZMQError):  # unreachable, or the client is closing
                    pass

    async def generate(self, prompt=None, **kw) -> Result:
        last = None
        async for last in self.stream(prompt, **kw):
            pass
        return last.result

    async def abort(self, request_id: str) -> None:
        await _send_now(self.sock, encode(AbortRequest(request_id)))

    async def stats(self, timeout: float = 10.0) -> dict:
        self._renew()
        self._ensure_reader()
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        await _send_now(self.sock, encode(StatsRequest()))
        async with asyncio.timeout(timeout):  # see stream(): wait_for could swallow a cancellation
            return await fut


__all__ = [
    "DEFAULT_ADDRESS", "AsyncClient", "Client", "ClientError", "ClientTooSlow", "CoordinatorUnreachable", "InvalidRequest", "NoWorkers",
    "Overloaded", "PromptTooLong", "RequestError", "RequestLost", "RequestTimeout", "Result", "StreamDelta", "WorkerLost",
    "build_request", "encode_request", "request_error", "to_delta",
]
