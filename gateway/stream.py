"""The coordinator streams behind one HTTP request, and what ends them when the client leaves.

Lifecycle: a `Fanout` runs one `AsyncClient.stream` per job (n > 1 and batched prompts are
several jobs), each holding one of the gateway's slots (gateway/slots.py): the jobs its fair
share allows start at once (none: `Overloaded`, a 429), the rest start one by one as slots come
back. The jobs that score a prompt start first; a job that shares another's prompt scores
(Job.scores_from, gateway/scoring.py) waits for them, queues them as its own first delta and
puts them on its result, then runs without scoring (its prompt is then in the prefix cache);
if the scoring job ends without them, the sharers end with its error. Each is pumped by a task into one queue of (choice index, delta | error | None for
"ended"). A streaming response first awaits `first()` (the first delta of every stream started
at once, or the first error, so that an immediate refusal still becomes an HTTP status), then
drains `next_event()`; a whole response awaits `results()`. `close()` cancels the pumps that
are still running: cancelling `AsyncClient.stream` sends AbortRequest, so the workers free the
request's blocks. The events queued and not yet handed out are counted in bytes (`event_bytes`):
an HTTP client that stops reading stops the response's writes (uvicorn waits for the socket), and
once more than `buffer_bytes` wait for it the fanout drops them, cancels every stream (their
blocks are freed) and leaves one `ClientTooSlow` error to be read. `EventStream` (the SSE response) and `unless_disconnected` watch the ASGI
receive channel and close the fanout the moment the client disconnects.
"""
from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse

from pdserve.gateway.config import STREAM_BUFFER_BYTES
from pdserve.gateway.schema import Job
from pdserve.gateway.slots import Slots
from pdserve_client.library import AsyncClient, ClientError, ClientTooSlow, Overloaded, RequestError, Result, StreamDelta

log = logging.getLogger("pdserve.gateway")

EVENT_OVERHEAD = 256  # bytes counted per queued delta beyond its contents (the delta, its tuple, the queue slot)
ITEM_BYTES = 32  # per token id or logprob held in a delta (a list slot and a Python number)
TOP_BYTES = 128  # per (token id, logprob) pair of top_logprobs (a tuple and two numbers)
SEND_IDS_PER_TURN = 131072  # prompt token ids the fan-out sends per turn of the event loop (~3 ms to copy and encode)


def event_bytes(item) -> int:
    """What a queued event holds in memory, roughly (an upper estimate for text: 4 bytes a character).
    A prompt's scores are not counted: they come once per choice, bounded before the request ran
    (max_scored_entries), and counted here they made one delta of a 1,525-token prompt's 20
    prompt_logprobs outgrow the whole buffer (client_too_slow before anyone could read it)."""
    if not isinstance(item, StreamDelta):
        return 0  # errors and end markers: at most two per stream, not counted
    top = sum(map(len, item.top_logprobs)) if item.top_logprobs else 0
    return EVENT_OVERHEAD + 4 * len(item.text) + ITEM_BYTES * (len(item.token_ids) + len(item.logprobs or ())) + TOP_BYTES * top


def send_turns(jobs: list[Job]) -> dict[int, int]:
    """The loop turns each job waits before its request is built and sent, in the order given: about
    SEND_IDS_PER_TURN prompt token ids a turn, so that 8 prompts of 131,072 ids go out over 8 turns
    with other streams between (at once they held the loop ~40 ms). {choice index: turns}."""
    turns, ids = {}, 0
    for j in jobs:
        turns[j.index] = ids // SEND_IDS_PER_TURN
        ids += len(j.inputs.get("token_ids") or ())
    return turns


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Fanout:
    def __init__(self, client: AsyncClient, jobs: list[Job], request_id: str, metrics, timeout: float, slots: Slots,
                 buffer_bytes: int = STREAM_BUFFER_BYTES):
        self.client, self.metrics, self.timeout, self.request_id = client, metrics, timeout, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer_bytes, self.buffered = buffer_bytes, 0  # the budget of queued events, and what is queued now
        self.buffer: list[tuple[int, object]] = []  # events read by first(), not yet handed out
        self.results: dict[int, Result] = {}
        self.open = len(jobs)
        loop = asyncio.get_running_loop()
        # a scoring choice's (prompt ids, scores), or None if it ended without them, for the choices that share them
        self.shared: dict[int, asyncio.Future] = {j.scores_from: loop.create_future() for j in jobs if j.scores_from is not None}
        order = sorted(jobs, key=lambda j: j.scores_from is not None)  # the scoring choices first: the others wait for them
        self.turns = send_turns(order)
        self.lease = slots.lease()
        self.tasks: list[asyncio.Future] = []
        while len(self.tasks) < len(order) and self.lease.try_take():
            self._start(order[len(self.tasks)])
        self.first_wave = len(self.tasks)
        if not self.tasks:
            self.lease.close()
            raise Overloaded("overloaded", f"the gateway has {slots.held} requests in flight (--max-inflight {slots.total}); retry later")
        self.feeder = asyncio.ensure_future(self._feed(order[self.first_wave:]))

    def _start(self, job: Job) -> None:
        task = asyncio.ensure_future(self._pump(job, f"{self.request_id}-{job.index}"))
        task.add_done_callback(lambda _: self.lease.give())  # also for a task cancelled before it ran
        self.tasks.append(task)

    async def _feed(self, jobs: list[Job]) -> None:
        """Start the jobs beyond this request's share, each as soon as it may hold a slot."""
        for job in jobs:
            await self.lease.take()
            self._start(job)

    async def _pump(self, job: Job, rid: str) -> None:
        ended = False
        scores = self.shared.get(job.index)  # this choice scores the prompt for others
        try:
            for _ in range(self.turns.get(job.index, 0)):  # its turn to be built and sent
                await asyncio.sleep(0)
            shared = await self._shared_scores(job)
            async for d in self.client.stream(**job.inputs, request_id=rid, timeout=self.timeout, priority=job.priority, **job.sampling):
                if scores is not None and d.prompt_logprobs is not None and not scores.done():
                    scores.set_result((d.prompt_token_ids, d.prompt_logprobs))
                if d.result is not None:
                    ended = True
                    if shared is not None:
                        d.result.prompt_token_ids, d.result.prompt_logprobs = shared
                    self.results[job.index] = d.result
                    self.metrics.observe(d.result)
                self._put(job.index, d)
        except ClientError as e:  # counted by type where it becomes an HTTP error, once per HTTP request
            ended = True
            self.queue.put_nowait((job.index, e))
        except asyncio.CancelledError:
            if not ended:
                self.metrics.aborted()
            raise
        except Exception as e:  # a bug must reach the HTTP client as a 500, not hang it
            ended = True
            log.exception("stream %s failed", rid)
            self.queue.put_nowait((job.index, e))
        finally:
            if scores is not None and not scores.done():
                scores.set_result(None)  # ended (or failed) before its scores: the choices sharing them end too
            self.queue.put_nowait((job.index, None))

    async def _shared_scores(self, job: Job) -> tuple | None:
        """For a choice that shares another's prompt scores: wait for them and queue them as its own
        first delta (it asked the workers for none). Raises if that choice ended without them."""
        if job.scores_from is None:
            return None
        shared = await self.shared[job.scores_from]
        if shared is None:  # its error (queued before this) is what the HTTP client sees
            raise RequestError("scores_unavailable", f"choice {job.scores_from}, whose prompt scores this choice shares, ended without them")
        self._put(job.index, StreamDelta("", [], prompt_token_ids=shared[0], prompt_logprobs=shared[1]))
        return shared

    def _put(self, index: int, d: StreamDelta) -> None:
        self.queue.put_nowait((index, d))
        self.buffered += event_bytes(d)
        if self.buffered > self.buffer_bytes:
            self._overflow(index)

    def _overflow(self, index: int) -> None:
        """The HTTP client leaves more than buffer_bytes unread: drop what waits for it, cancel
        every stream (this one too, at its next await: each sends its abort) and leave the error."""
        for t in [self.feeder, *self.tasks]:
            t.cancel()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.buffered = 0
        self.queue.put_nowait((index, ClientTooSlow("client_too_slow", f"aborted: the client left over {self.buffer_bytes} bytes of "
                                                                      "events unread (--stream-buffer-kb)")))

    async def first(self) -> None:
        """Wait until every stream started at once has sent something; raise the first error among them."""
        seen: set[int] = set()
        while len(seen) < self.first_wave:
            index, item = await self.queue.get()
            self.buffer.append((index, item))
            if isinstance(item, Exception):
                await self.close()
                raise item
            seen.add(index)

    async def next_event(self) -> tuple[int, StreamDelta] | None:
        """The next (choice index, delta) of any stream; None once all have ended."""
        while self.open:
            index, item = self.buffer.pop(0) if self.buffer else await self.queue.get()
            self.buffered = max(0, self.buffered - event_bytes(item))
            if item is None:
                self.open -= 1
            elif isinstance(item, Exception):
                await self.close()
                raise item
            else:
                return index, item
        return None

    async def results_in_order(self, jobs: list[Job]) -> list[Result]:
        while await self.next_event() is not None:
            pass
        return [self.results[j.index] for j in jobs]

    async def close(self) -> None:
        self.feeder.cancel()
        await asyncio.gather(self.feeder, return_exceptions=True)  # no job starts after this
        running = [t for t in self.tasks if not t.done()]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.lease.close()


async def disconnected(receive) -> None:
    """Returns when the ASGI server reports that the client went away."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive, coro):
    """Await coro, unless the client disconnects first (then cancel it and raise ClientGone)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator of str. When the client disconnects (ASGI
    servers such as uvicorn drop sends to a closed socket silently, so receive is watched) or
    the events end, the iterator is closed and `on_close` runs, aborting what still runs."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sending, watching):
                t.cancel()
            outcomes = await asyncio.gather(sending, watching, return_exceptions=True)
            await self.body_iterator.aclose()
            await self.on_close()
        for o in outcomes:
            if isinstance(o, Exception) and not isinstance(o, OSError):
                log.error("event stream failed", exc_info=o)
