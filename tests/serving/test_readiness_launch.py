"""Readiness that means ready, through a real `pdserve launch --decode 2` (tiny random model): a
probe polls /health/ready from before the launch starts. One decode worker is stopped (SIGSTOP)
before it can register: while the other decode worker and the prefill worker are registered the
probe sees 503 naming the missing one (/health, liveness, answers 200 all along); once it is let go
and registers, 200. The probe never sees ready with fewer than the three workers the launch
started, and never not ready again once ready."""
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model

MISSING = "local-decode-1"


def child_pid(launcher: int, worker_id: str) -> int | None:
    """The pid of the launcher's child running worker `worker_id` (None before it is started)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(launcher)], capture_output=True, text=True).stdout
    return next((int(line.split()[0]) for line in out.splitlines() if f"--worker-id {worker_id} " in line + " "), None)


class Probe:
    """/health/ready and /health, polled every 50 ms on a thread: (ready status, workers registered, reason, liveness status)."""

    def __init__(self, url: str):
        self.url, self.views, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        with httpx.Client(timeout=2) as h:
            while not self.stop.is_set():
                try:
                    r = h.get(f"{self.url}/health/ready")
                    live = h.get(f"{self.url}/health").status_code
                    self.views.append((r.status_code, sum(r.json().get("workers", {}).values()), r.json().get("reason", ""), live))
                except httpx.HTTPError:
                    self.views.append((None, 0, "no answer", None))  # the gateway is not up yet
                time.sleep(0.05)

    def seen(self, status: int, workers: int) -> bool:
        return any(v[:2] == (status, workers) for v in self.views)


@pytest.mark.timeout(300)  # a launch of three workers: 20-60 s on 2 loaded cores
def test_ready_only_once_both_decode_workers_and_the_prefill_worker_registered(tmp_path):
    model = tmp_path / "model"
    save_tiny_served_model(model, max_position_embeddings=256)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    probe = Probe(url)
    err = open(tmp_path / "launch.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--model", str(model), "--decode", "2", "--threads", "1",
                             "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}",
                             "--http-port", str(port), "--log-dir", str(tmp_path / "logs")], stderr=err)
    try:
        pid = poll(lambda: proc.poll() is None and child_pid(proc.pid, MISSING), timeout=60, every=0.01)
        os.kill(pid, signal.SIGSTOP)  # it cannot register (a worker takes seconds to import torch and load)
        try:
            # the other decode worker and the prefill worker registered: not ready, the missing one named
            poll(lambda: probe.seen(503, 2), timeout=180, every=0.1)
            status, _, reason, live = next(v for v in probe.views if v[:2] == (503, 2))
            assert MISSING in reason and live == 200, (reason, live)
        finally:
            os.kill(pid, signal.SIGCONT)
        poll(lambda: probe.seen(200, 3), timeout=120, every=0.1)
        poll(lambda: len(probe.views) > [v[0] for v in probe.views].index(200) + 10, timeout=10)  # a second more of the probe's view
    finally:
        probe.stop.set()
        probe.thread.join(10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        err.close()
    statuses = [v[0] for v in probe.views]
    first_ready = statuses.index(200)
    assert set(statuses[:first_ready]) <= {None, 503} and 503 in statuses[:first_ready], statuses  # not ready, then ready
    assert set(statuses[first_ready:]) == {200}, statuses  # never not ready again
    assert all(workers == 3 for status, workers, _, _ in probe.views if status == 200), probe.views  # never ready before all three
    assert all(live == 200 for status, _, _, live in probe.views if status is not None)  # alive whenever it answered
