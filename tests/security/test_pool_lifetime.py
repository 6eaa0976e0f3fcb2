"""KV pools do not outlive their workers for long: a SIGKILL of a whole `pdserve launch` process
group (the OOM killer, docker kill, Kubernetes after its grace period) leaves each worker's pool
in this user's pool directory, since nothing of the node runs to unlink it; the next launch
removes them before it starts any worker (so before any sizes its KV from /dev/shm's free space),
says so, and then serves and stops cleanly. The launches here keep their pools under a directory of
their own ($PDSERVE_SHM_DIR): a worker another test starts meanwhile sweeps this user's pool
directory too, and once removed these pools before the second launch could (CI, two test processes)."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.kvtransfer.pool_files import start_time
from tests.helpers import free_port, pools_of, save_tiny_served_model
from tests.serving.test_launcher import children_of, wait_ready


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


def launch(model_dir, log_dir):
    """A `pdserve launch` of one prefill and one decode worker in a session (process group) of its
    own; returns (process, client address, queue of its stderr lines)."""
    clients, workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--clients", clients,
                             "--workers", workers, "--threads", "1", "--no-gateway", "--log-dir", str(log_dir),
                             "--engine-arg=--kv-cache-mb=8"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    return proc, clients, lines


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(start_time(p) is not None for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if start_time(p) is not None]}"
        time.sleep(0.05)


def line_with(lines: queue.Queue, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line with {text!r} within {timeout:g} s") from None
        if text in line:
            return line


@pytest.mark.timeout(180)  # two launches of the tiny model: 20-40 s on 2 cores
def test_pools_left_by_a_sigkilled_process_group_are_removed_by_the_next_launch(model_dir, tmp_path, own_shm_dir):
    proc, clients, _ = launch(model_dir, tmp_path / "first")
    try:
        wait_ready(proc, clients, 2)
        kids = children_of(proc.pid)
        left = pools_of(*kids)
        assert left and all(p.startswith(own_shm_dir) for p in left), "the workers' shared pools, in their own directory"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole node at once: no launcher survives to sweep
        proc.wait(timeout=30)
    wait_gone(kids)
    assert all(os.path.exists(p) for p in left)  # the kernel does not free a file: the next start must

    proc, clients, lines = launch(model_dir, tmp_path / "second")
    try:
        said = line_with(lines, "KV pools", 60)  # printed before any worker starts
        assert "whose workers are gone" in said and all(os.path.basename(p) in said for p in left)
        assert not any(os.path.exists(p) for p in left)
        wait_ready(proc, clients, 2)
        kids = children_of(proc.pid)
        assert pools_of(*kids)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    wait_gone(kids)
    assert not pools_of(*kids)
