"""/health is cheap and an HTTP client that stops reading is bounded, through real processes.
- A gateway in front of a stand-in coordinator (a ROUTER in this test that answers StatsRequest
  and counts them): 300 concurrent /health calls cost it no StatsRequest each (the gateway asks
  about once a second), and /health/ready follows the coordinator's answer (ready -> 503 when the
  workers are gone; /health, liveness, stays 200) within a few refreshes.
- A real cluster whose gateway has --stream-buffer-kb 16: a streaming chat (n=4, top-20 logprobs)
  whose client never reads is aborted on the coordinator (its requests end, finished:abort) once
  its unread events pass the budget, and every KV block comes back."""
import asyncio
import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import zmq

from pdserve_client.library import Client
from pdserve_client.protocol import ClientToCoordinator, StatsReply, StatsRequest, decoder, encode
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model, start_cluster, wait_all_blocks_free


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=1024)
    return d


class StandIn:
    """A coordinator stand-in: answers every StatsRequest with `workers`, counting them."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.asked = 0
        self.workers = [{"role": "colocated", "max_model_len": 1024}]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        dec = decoder(ClientToCoordinator)
        while not self.stop.is_set():
            if self.sock.poll(50):
                ident, body = self.sock.recv_multipart()
                if isinstance(dec.decode(body), StatsRequest):
                    self.asked += 1
                    self.sock.send_multipart([ident, encode(StatsReply(json.dumps({"workers": self.workers}).encode()))])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


def test_health_answers_many_probes_from_a_summary(model_dir, tmp_path):
    coord = StandIn()
    port = free_port()
    log = open(tmp_path / "gateway.log", "w")
    gw = subprocess.Popen([sys.executable, "-m", "pdserve", "gateway", "--coordinator", f"tcp://127.0.0.1:{coord.port}",
                           "--port", str(port), "--model", str(model_dir)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/health"
    try:
        def ready():
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        poll(ready, timeout=90, every=0.2)

        async def burst():
            async with httpx.AsyncClient(timeout=30) as h:
                return await asyncio.gather(*(h.get(url) for _ in range(300)))
        asked = coord.asked
        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 300 and answers[0].json() == {"status": "ready", "workers": {"colocated": 1}}
        assert coord.asked - asked <= 10, coord.asked - asked  # ~1 a second while the burst ran, not 300
        coord.workers = []
        poll(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503, timeout=5)
        assert "no decode or colocated worker" in httpx.get(f"{url}/ready", timeout=2).json()["reason"]
        assert httpx.get(url, timeout=2).status_code == 200  # /health is liveness: the gateway answers
    finally:
        gw.terminate()
        gw.wait(30)
        log.close()
        coord.close()


def test_a_stream_nobody_reads_is_aborted_past_its_buffer(model_dir, tmp_path):
    cluster = start_cluster(model_dir, tmp_path, gateway=True, http_port=free_port(), gateway_args=["--stream-buffer-kb", "16"])
    try:
        body = json.dumps({"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 4,
                           "max_tokens": 900, "logprobs": True, "top_logprobs": 20, "ignore_eos": True}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window, nothing read after
        s.connect(("127.0.0.1", cluster.plan.http_port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        with Client(cluster.plan.client_addr, timeout=30) as c:
            # the 4 choices start, then are aborted long before 900 tokens (too quickly to see them all running)
            poll(lambda: (s := c.stats())["requests"].get("requests", 0) == 4 and s["active_requests"] == 0, timeout=60)
            stats = wait_all_blocks_free(c, timeout=30)
            assert stats["requests"].get("finished:abort", 0) == 4 and stats["requests"].get("finished:length", 0) == 0
        s.close()
    finally:
        cluster.stop()
