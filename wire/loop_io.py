"""ZeroMQ sockets served from a running asyncio loop without a future per message.

Lifecycle: a `SocketIO` wraps one plain (synchronous) zmq socket owned by an asyncio server.
`start()`, inside the running loop, registers the socket's file descriptor with
`loop.add_reader`; `messages()` yields every multipart message as it arrives; `send()` never
blocks and says whether the message was queued (False: the peer is gone, or its queue is at the
high-water mark); `stop()` unregisters the descriptor. The caller closes the socket after
`stop()`.

Why not zmq.asyncio's awaited recv and send: each creates a Future and runs callbacks per
message, a large share of the coordinator's CPU per request (docs/performance.md, "Measuring",
the coordinator with stub workers). Here one wake-up drains every waiting message with
non-blocking calls (`drain_batch` at most before the loop gets a turn).

ZeroMQ's descriptor is edge-triggered and is also consumed by sends on the same socket, so
readiness is checked again with ZMQ_EVENTS before every wait and after every send (as pyzmq's
own asyncio socket does).
"""
from __future__ import annotations

import asyncio

import zmq


class SocketIO:
    def __init__(self, sock: zmq.Socket, drain_batch: int = 256):
        self.sock = sock
        self.drain_batch = drain_batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._fd: int | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._ready.set)

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._loop = self._fd = None

    def _recheck(self) -> None:
        if self._ready is not None and not self._ready.is_set() and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._ready.set()

    def send(self, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
            sent = True
        except zmq.ZMQError:  # EAGAIN at the high-water mark, EHOSTUNREACH with ROUTER_MANDATORY
            sent = False
        self._recheck()
        return sent

    async def messages(self):
        """Every message as it arrives (multipart frames); runs until cancelled."""
        if self._ready is None:
            self.start()
        while True:
            for _ in range(self.drain_batch):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                yield frames
            else:
                await asyncio.sleep(0)  # a long burst: let the other sockets and timers run
                continue
            self._ready.clear()
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue  # arrived between the last receive and the clear
            await self._ready.wait()
