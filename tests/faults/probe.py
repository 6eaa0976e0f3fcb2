"""A greedy probe stream read over HTTP in its own process, for the no-stall tests: each token's
arrival time is kept (CLOCK_MONOTONIC, one clock for every process) until the test stops it, so
the test's own work never delays the probe's reads.

Lifecycle: `Probe(url, model)` -> `start()` -> poll `count` -> `finish()` -> `gaps()`.
"""
import multiprocessing
import time

import httpx


def read_probe(url: str, model: str, count, stop, conn) -> None:
    """A greedy stream read over HTTP in its own process (so the test's own work never delays its
    reads), each token's arrival time kept until `stop` is set; sends (times, error) on conn."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 3500, "temperature": 0, "ignore_eos": True, "stream": True}
    times, error = [], None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process
                    count.value = len(times)
                if stop.is_set():
                    break
    except Exception as e:
        error = repr(e)
    conn.send((times, error))


class Probe:
    def __init__(self, url: str, model: str):
        mp = multiprocessing.get_context("spawn")
        self.count, self.stop = mp.Value("i", 0), mp.Event()
        self.conn, child = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=read_probe, args=(url, model, self.count, self.stop, child), daemon=True)
        self.times: list[float] = []
        self.error: str | None = None

    def start(self):
        self.proc.start()

    def finish(self):
        self.stop.set()
        assert self.conn.poll(60), "the probe did not report"
        self.times, self.error = self.conn.recv()
        self.proc.join(10)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]
