"""A worker's connection to the coordinator, run by one I/O thread.

Lifecycle: `WorkerLink.start(heartbeat)` opens a DEALER to the coordinator's worker port and
sends the worker's Hello; the thread then (a) forwards decoded coordinator messages into `inbox`,
(b) sends what the model loop hands to `send()` (through an inproc socket owned by the calling
thread, so no socket is ever shared between threads), (c) sends a Heartbeat every interval, and
(d) polls any extra sockets registered with `watch()` (the decode worker's kv socket),
putting what their handlers return into the inbox. A coordinator that forgets the worker
(restart) answers a heartbeat with Reject("unregistered"), and the link says Hello again.
`stop()` ends the thread and closes every socket. The model loop only touches `inbox`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import msgspec
import zmq

from pdserve.wire.protocol import CoordinatorToWorker, Hello, Reject, Welcome
from pdserve_client.protocol import MAX_CONTROL_MESSAGE, decoder, encode

log = logging.getLogger("pdserve.link")


class CoordinatorRestarted:
    """Inbox marker: the coordinator forgot this worker, so every request it holds is orphaned."""


class WorkerLink:
    INBOX_SIZE = 65536  # messages the model loop has not taken yet; beyond this they are dropped and counted

    def __init__(self, ctx: zmq.Context, address: str, hello: Hello, heartbeat=None, interval: float = 0.5, curve: dict | None = None):
        self.ctx = ctx
        self.address = address
        self.hello = hello
        self.heartbeat = heartbeat  # () -> Heartbeat, called from the I/O thread (given here or to start)
        self.interval = interval
        self.curve = curve or {}
        self.inbox: queue.Queue = queue.Queue(maxsize=self.INBOX_SIZE)  # bounded: see _put
        self.dropped = 0  # messages dropped because the inbox was full (reported in heartbeats)
        self.registered = threading.Event()
        self.welcome: Welcome | None = None  # the coordinator's last Welcome (its TPOT target)
        self.bad_messages = 0
        self._pipe = f"inproc://link-{uuid.uuid4().hex}"
        self._local = threading.local()
        self._watched: list[tuple[zmq.Socket, callable]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)
        self._pull = ctx.socket(zmq.PULL)
        self._pull.bind(self._pipe)

    def watch(self, sock: zmq.Socket, handler) -> None:
        """Poll sock in the I/O thread; handler(sock) returns a message for the inbox or None."""
        self._watched.append((sock, handler))

    def start(self, heartbeat=None) -> None:
        if heartbeat is not None:
            self.heartbeat = heartbeat
        self._thread.start()

    def send(self, msg: msgspec.Struct) -> None:
        """Thread-safe: queue msg for the coordinator via this thread's own inproc socket."""
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self._pipe)
        push.send(encode(msg))

    def drain(self, timeout: float | None) -> list:
        """Everything in the inbox; waits up to timeout for the first item (None: forever)."""
        items = []
        try:
            items.append(self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ I/O thread

    def _dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue messages for a coordinator that is not there
        for opt, value in self.curve.items():
            sock.setsockopt(opt, value)
        sock.connect(self.address)
        return sock

    def _run(self) -> None:
        dec = decoder(CoordinatorToWorker)
        dealer = self._dealer()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        for sock, _ in self._watched:
            poller.register(sock, zmq.POLLIN)
        handlers = {sock: h for sock, h in self._watched}
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    _send(dealer, encode(self.heartbeat() if self.registered.is_set() else self.hello))
                    next_beat = now + (self.interval if self.registered.is_set() else min(self.interval, 0.2))
                for sock, _ in poller.poll(timeout=max(1, int((next_beat - time.monotonic()) * 1000))):
                    if sock is dealer:
                        self._from_coordinator(dealer, dec)
                    elif sock is self._pull:
                        _send(dealer, self._pull.recv())
                    else:
                        msg = handlers[sock](sock)
                        if msg is not None:
                            self._put(msg)
        finally:
            dealer.close(linger=0)
            self._pull.close(linger=0)

    def _from_coordinator(self, dealer: zmq.Socket, dec) -> None:
        try:
            msg = dec.decode(dealer.recv())
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.bad_messages += 1
            return
        if isinstance(msg, Welcome):
            self.welcome = msg
            self.registered.set()
            log.info("registered with the coordinator at %s", self.address)
        elif isinstance(msg, Reject):
            if msg.reason == "unregistered":
                if self.registered.is_set():
                    self._put(CoordinatorRestarted())
                self.registered.clear()  # the coordinator restarted: say Hello again
            else:
                log.error("coordinator rejected this worker: %s", msg.reason)
                self._put(msg)
        else:
            self._put(msg)

    def _put(self, msg) -> None:
        """Never block the I/O thread (it must keep heartbeating): a full inbox drops and counts."""
        try:
            self.inbox.put_nowait(msg)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("inbox full (%d messages): %d dropped so far", self.inbox.maxsize, self.dropped)


def _send(sock: zmq.Socket, data: bytes) -> bool:
    """Never block the I/O thread: with no coordinator connected the message is dropped."""
    try:
        sock.send(data, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
