"""A greedy probe stream read over HTTP in its own process, for the no-stall tests: each token's
arrival time is kept (CLOCK_MONOTONIC, one clock for every process) until the test stops it, so
the test's own work never delays the probe's reads.

Lifecycle: `Probe(url, model)` -> `start()` -> poll `count` -> `finish()` -> `gaps()`.
`launched(tmp_path_factory, *flags)` starts the node they run against (`pdserve launch`, a tiny
random model with the default model's tokenizer, 4096 positions) and stops it; `client_socket`
is a raw socket to its coordinator's client port with the launch's own keys.
"""
import contextlib
import multiprocessing
import subprocess
import sys
import time

import httpx
import zmq

from pdserve_client.keys import client_options, launch_keys_for
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model


def client_socket(clients: str) -> zmq.Socket:
    """A DEALER connected to the client port `clients` with the keys a Client would find (the launch's own)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    for opt, value in client_options(launch_keys_for(clients)).items():
        s.setsockopt(opt, value)
    s.connect(clients)
    return s


@contextlib.contextmanager
def launched(tmp_path_factory, *flags):
    """`pdserve launch` with the gateway on free loopback ports; yields {url, clients, model, pid, logs}."""
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d, max_position_embeddings=4096)
    clients, workers, port = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    logs = tmp_path_factory.mktemp("logs")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--model", str(d), "--clients", clients, "--workers", workers,
                             "--threads", "1", "--http-port", str(port), "--log-dir", str(logs), *flags], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():  # both workers registered (/health is ready with the decode worker alone: it prefills locally)
            assert proc.poll() is None, "pdserve launch exited early"
            try:
                r = httpx.get(f"{url}/health/ready", timeout=2)
                return r.status_code == 200 and sum(r.json()["workers"].values()) >= 2
            except httpx.HTTPError:
                return False

        poll(ready, timeout=180, every=0.3)
        yield {"url": url, "clients": clients, "model": d.name, "pid": proc.pid, "logs": logs}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def read_probe(url: str, model: str, count, stop, conn) -> None:
    """Greedy streams read over HTTP in their own process (so the test's own work never delays
    their reads), one after another until `stop` is set, each token's arrival time kept; sends
    (times, stream starts: the index of each stream's first token, error) on conn."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 3500, "temperature": 0, "ignore_eos": True, "stream": True}
    times, starts, error = [], [], None
    try:
        while not stop.is_set():
            starts.append(len(times))
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process
                        count.value = len(times)
                    if stop.is_set():
                        break
    except Exception as e:
        error = repr(e)
    conn.send((times, starts, error))


class Probe:
    def __init__(self, url: str, model: str):
        mp = multiprocessing.get_context("spawn")
        self.count, self.stop = mp.Value("i", 0), mp.Event()
        self.conn, child = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=read_probe, args=(url, model, self.count, self.stop, child), daemon=True)
        self.times: list[float] = []
        self.starts: list[int] = []
        self.error: str | None = None

    def start(self):
        self.proc.start()

    def finish(self):
        self.stop.set()
        assert self.conn.poll(60), "the probe did not report"
        self.times, self.starts, self.error = self.conn.recv()
        self.proc.join(10)

    def gaps(self) -> list[tuple[float, float]]:
        """(when the gap began, its length) between consecutive tokens of one stream (the wait
        for a next stream's first token is its TTFT, not a gap)."""
        firsts = set(self.starts)
        return [(self.times[i - 1], self.times[i] - self.times[i - 1]) for i in range(1, len(self.times)) if i not in firsts]
