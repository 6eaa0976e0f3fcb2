"""A launcher's lines to one model's coordinator: its stats (StatsRequest, on the client port
with the client keys, as any client asks), and its node's restart counts (NodeReport) and the
workers it is about to remove (DrainWorker), sent on the coordinator's worker port with the
cluster's worker keypair. That port admits only worker keys (wire/security.py), so draining a
worker takes what registering one takes: a client-key holder (an application, the gateway) cannot
drain one, and the client port does not decode these messages at all.

Lifecycle: the launcher makes one per model (`pdserve.launch.Launch.clients`) for as long as it waits
or supervises, and closes it. Sends never block: with no connection (a coordinator down or restarting) the
message is dropped, and both are sent again at the launcher's next tick.
"""
from __future__ import annotations

import zmq

from pdserve.wire.protocol import DrainWorker, NodeReport
from pdserve.wire.security import worker_options
from pdserve_client.protocol import MAX_CONTROL_MESSAGE, encode


class LauncherLink:
    def __init__(self, client_addr: str, worker_addr: str, keys: str | None, timeout: float = 2.0):
        from pdserve_client.library import Client

        self.client = Client(client_addr, timeout=timeout, keys=keys)
        self.sock = self.client.ctx.socket(zmq.DEALER)  # (the client's context: closed with it)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        for opt, value in worker_options(keys).items():
            self.sock.setsockopt(opt, value)
        self.sock.connect(worker_addr)

    def _send(self, msg) -> bool:
        """Send msg if a connection is up; False if it was dropped (the next tick sends it again)."""
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def report_node(self, node: str, restarts: dict[str, int], last_exit: dict[str, str]) -> bool:
        """This node's restart counts and last exits by role name (shown by `pdserve stats` under `nodes`)."""
        return self._send(NodeReport(node, restarts, last_exit))

    def drain_worker(self, worker_id: str) -> bool:
        """The coordinator places nothing more on worker_id (its stats' `draining` shows it): it is about to be removed."""
        return self._send(DrainWorker(worker_id))

    def stats(self, timeout: float = 10.0) -> dict:
        """The coordinator's stats (pdserve_client's Client.stats: ClientError if it does not answer)."""
        return self.client.stats(timeout=timeout)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.client.close()
