"""`pdserve launch` supervises its node, run as a user runs it (the CLI in a subprocess): a
decode worker killed with streams in flight is restarted while the others keep serving and
every stream completes identically or ends with a typed error; a killed coordinator and gateway
come back and the workers re-join; request ids differ across a coordinator restart and a
worker's message about a request placed elsewhere is ignored; a hung (SIGSTOPped) worker is
killed and restarted; a role that keeps crashing is retried with a growing back-off while the
node serves; only a configuration error (a bad flag, a missing model, a value a worker rejects,
a pool /dev/shm cannot hold) stops the node, with the error printed. Each test ends with every
pool whole."""
import asyncio
import glob
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from pdserve.kvtransfer.pool import host_identity
from pdserve.wire import security
from pdserve.wire.liveness import LIVENESS_ENV
from pdserve.wire.protocol import PROTOCOL_VERSION, CoordinatorToWorker, Generate, Heartbeat, Hello, Reject, Role, TokenBatch, TokenOut, Welcome
from pdserve_client.library import Client, ClientError, RequestError, RequestLost
from pdserve_client.protocol import FinishReason, decoder, encode
from tests.faults.test_worker_death import run_and_kill
from tests.helpers import free_port, pools_of, wait_all_blocks_free
from tests.helpers import stream_prompts as prompts

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def model_dir(kill_model_dir):
    return kill_model_dir


@pytest.fixture(scope="module")
def expected(kill_expected):
    """The single-process greedy tokens of prompts(8) (tests/faults/conftest.py, shared with test_worker_death.py)."""
    return [e[:MAX_TOKENS] for e in kill_expected]


class Node:
    """`pdserve launch` in a subprocess, its stderr in a file."""

    def __init__(self, model_dir, tmp_path, *args):
        self.clients = f"tcp://127.0.0.1:{free_port()}"
        self.workers = f"tcp://127.0.0.1:{free_port()}"
        self.http = f"http://127.0.0.1:{free_port()}"
        self.err_path = tmp_path / "launch.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--clients", self.clients, "--workers", self.workers,
             "--http-port", self.http.rsplit(":", 1)[1], "--threads", "1", "--no-slo", "--log-dir", str(tmp_path), *args],
            stderr=open(self.err_path, "w"),
        )

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_workers(self, n: int, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        with Client(self.clients, timeout=2) as c:
            while True:
                assert self.proc.poll() is None, f"launcher exited: {self.stderr()}"
                try:
                    stats = c.stats(timeout=1)
                    if len(stats["workers"]) >= n:
                        return stats
                except ClientError:
                    pass
                assert time.monotonic() < deadline, "node not ready in time"
                time.sleep(0.2)

    def keys(self) -> str | None:
        """The CurveZMQ keys the launcher handed its coordinator (without --keys: the launch's own, wire/security.py)."""
        args = open(f"/proc/{self.child('coordinator')}/cmdline").read().split("\0")
        return args[args.index("--keys") + 1] if "--keys" in args else None

    def child(self, role: str) -> int | None:
        """The pid of the launcher's live child running `pdserve ROLE` or `pdserve worker ... --role ROLE` (None between a
        death and its restart). -ww: ps cuts command lines at $COLUMNS (80 under pytest) without it."""
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True, text=True).stdout
        pids = [int(line.split()[0]) for line in out.splitlines() if f"pdserve {role} " in line or f"--role {role} " in line]
        assert len(pids) <= 1, out
        return pids[0] if pids else None

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def poll(what: str, check, timeout: float):
    """check() until it returns something true; AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except ClientError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.1)


def restarts(c: Client, role: str) -> int:
    return c.stats()["nodes"].get("local", {}).get("restarts", {}).get(role, 0)



def test_launch_restarts_a_killed_decode_worker_and_every_stream_completes(model_dir, expected, tmp_path):
    node = Node(model_dir, tmp_path, "--decode", "2", "--engine-arg=--kv-cache-mb=16")
    try:
        node.wait_workers(3)
        victim = {}

        def kill_busiest():
            with Client(node.clients, timeout=5) as c:
                decodes = [w for w in c.stats()["workers"] if w["role"] == "decode"]
            busiest = max(decodes, key=lambda w: w["inflight"])
            victim.update(busiest)
            os.kill(busiest["pid"], signal.SIGKILL)

        outs = asyncio.run(run_and_kill(node.clients, kill_busiest, 150, max_tokens=MAX_TOKENS, timeout=90))
        killed_at = time.monotonic()
        for i, (r, after) in enumerate(outs):  # none hangs: every stream ended, each within a bound
            if isinstance(r, RequestError):
                assert r.code in ("worker_lost", "kv_transfer_failed", "kv_transfer_timeout"), r
                assert after < 10, f"stream {i} failed {after:.1f} s after the kill"
            else:
                assert r == expected[i], f"stream {i} completed with other tokens"
        assert victim["inflight"] >= 1
        role = victim["id"].removeprefix("local-")
        with Client(node.clients, timeout=30) as c:
            back = poll("the killed worker's return", lambda: [w for w in c.stats()["workers"]
                                                               if w["id"] == victim["id"] and w["pid"] != victim["pid"]], 30)
            assert time.monotonic() - killed_at < 30 and back[0]["role"] == "decode"
            r = c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=20, ignore_eos=True)
            assert r.token_ids == expected[0][:20]
            poll("the restart count in stats", lambda: restarts(c, role) == 1, 10)
            stats = c.stats()
            assert stats["requests"]["workers_lost"] == 1 and stats["nodes"]["local"]["last_exit"][role] == "signal SIGKILL"
            assert len(stats["workers"]) == 3
            wait_all_blocks_free(c, timeout=10)
        assert f"{role} (pid {victim['pid']}) exited with signal SIGKILL; restarting" in node.stderr()
        assert not pools_of(victim["pid"])  # the dead worker's pool is gone
    finally:
        assert node.stop() == 0


class FakeWorker:
    """A colocated worker speaking the protocol by hand on its own thread: registers (again after
    Reject "unregistered"), heartbeats, and queues every Generate it receives."""

    def __init__(self, address: str, wid: str, keys: str | None = None):
        self.wid = wid
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for opt, value in security.worker_options(keys).items():  # a worker of this launch: its worker keypair
            self.sock.setsockopt(opt, value)
        self.sock.connect(address)
        self.lock = threading.Lock()
        self.generates: queue.Queue = queue.Queue()
        self.registered = threading.Event()
        self.stop = threading.Event()
        host, boot = host_identity()
        self.hello = Hello(PROTOCOL_VERSION, wid, Role.COLOCATED, os.getpid(), host, boot, "fake", 512, 64, 16)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def send(self, msg) -> None:
        with self.lock:
            self.sock.send(encode(msg))

    def run(self) -> None:
        dec = decoder(CoordinatorToWorker)
        next_beat = 0.0
        while not self.stop.is_set():
            if time.monotonic() >= next_beat:
                self.send(Heartbeat(self.wid, 64, 0, 0, 0) if self.registered.is_set() else self.hello)
                next_beat = time.monotonic() + 0.2
            with self.lock:
                msg = dec.decode(self.sock.recv()) if self.sock.poll(0) else None
            if isinstance(msg, Welcome):
                self.registered.set()
            elif isinstance(msg, Reject):
                self.registered.clear()
            elif isinstance(msg, Generate):
                self.generates.put(msg)
            elif msg is None:
                time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_coordinator_and_gateway_restart_with_fresh_request_ids_and_identity_checks(model_dir, tmp_path):
    node = Node(model_dir, tmp_path, "--prefill", "0", "--decode", "0")
    worker = rogue = None
    pool = ThreadPoolExecutor(2)
    try:
        node.wait_workers(0)
        worker = FakeWorker(node.workers, "fake-0", node.keys())
        with Client(node.clients, timeout=30) as c:
            poll("the fake worker's registration", lambda: len(c.stats()["workers"]) == 1, 10)
            epoch = c.stats()["epoch"]
        first = pool.submit(generate, node.clients, [1, 2, 3])
        old = worker.generates.get(timeout=10).request_id
        os.kill(node.child("coordinator"), signal.SIGKILL)
        with pytest.raises(RequestLost):  # once the new coordinator answers (its start takes 5-30 s on a busy 2-core machine)
            first.result(timeout=120)
        with Client(node.clients, timeout=30) as c:  # the launcher restarted it; the worker re-joined by itself
            poll("the new coordinator with the worker", lambda: (s := c.stats())["epoch"] != epoch and len(s["workers"]) == 1, 60)
            second = pool.submit(generate, node.clients, [4, 5, 6])
            new = worker.generates.get(timeout=10).request_id
            assert new != old  # ids carry the coordinator's epoch
            worker.send(TokenBatch([TokenOut(old, 42, finish_reason=FinishReason.STOP)]))  # late, from before the restart
            rogue = FakeWorker(node.workers, "fake-1", node.keys())
            poll("the rogue's registration", lambda: len(c.stats()["workers"]) == 2, 10)
            rogue.send(TokenBatch([TokenOut(new, 43, finish_reason=FinishReason.STOP)]))  # not placed there
            poll("the rogue's message counted", lambda: c.stats()["requests"].get("wrong_worker_messages", 0) >= 1, 10)
            worker.send(TokenBatch([TokenOut(new, 7), TokenOut(new, 8, finish_reason=FinishReason.LENGTH)]))
            assert second.result(timeout=20).token_ids == [7, 8]
            poll("the coordinator's restart count", lambda: restarts(c, "coordinator") == 1, 10)
            gateway = node.child("gateway")
            os.kill(gateway, signal.SIGKILL)
            poll("the gateway's return", lambda: node.child("gateway") not in (None, gateway) and health(node.http), 90)
            poll("the gateway's restart count", lambda: restarts(c, "gateway") == 1, 10)
            assert c.stats()["active_requests"] == 0
        assert "coordinator (pid" in node.stderr() and "gateway (pid" in node.stderr()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for w in (worker, rogue):
            if w is not None:
                w.close()
        assert node.stop() == 0


def generate(address: str, prompt: list[int]):
    with Client(address, timeout=150) as c:
        return c.generate(token_ids=prompt, max_tokens=4)


def health(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True  # 503 without workers: it answers
    except OSError:
        return False


HANG_TIMEOUT_S = 5.0  # short for the test; the default (60 s) is above the longest legitimate loop pass


def test_a_hung_worker_is_killed_and_restarted(model_dir, tmp_path):
    node = Node(model_dir, tmp_path, "--hang-timeout-s", str(HANG_TIMEOUT_S), "--engine-arg=--kv-cache-mb=16")
    try:
        stats = node.wait_workers(2)
        # each role's loop touches its file (or it is not watched): all four watched at once
        paths = {role: liveness_file(node.child(role)) for role in ("coordinator", "gateway", "prefill", "decode")}
        first = {role: poll(f"{role}'s liveness file", lambda: os.path.exists(path) and os.stat(path).st_mtime_ns, 10)
                 for role, path in paths.items()}
        for role, path in paths.items():
            poll(f"{role}'s next touch", lambda: os.stat(path).st_mtime_ns != first[role], 5)
        victim = next(w for w in stats["workers"] if w["role"] == "decode")
        os.kill(victim["pid"], signal.SIGSTOP)  # its loop stops; the process lives
        stopped_at = time.monotonic()
        # noticed within the timeout (+ a touch period), SIGKILL after the 5 s grace at worst, restarted after 1 s
        poll("the hung worker's replacement", lambda: node.child("decode") not in (None, victim["pid"]), HANG_TIMEOUT_S + 15)
        assert time.monotonic() - stopped_at > HANG_TIMEOUT_S  # not before the timeout
        err = node.stderr()
        assert f"decode-0 (pid {victim['pid']}) hung: its loop has not run for" in err
        assert f"decode-0 (pid {victim['pid']}) exited with " in err and " (hung: killed); restarting in 1.0 s (restart 1)" in err
        with Client(node.clients, timeout=30) as c:
            poll("the restarted worker's registration", lambda: [w for w in c.stats()["workers"]
                                                                 if w["id"] == victim["id"] and w["pid"] != victim["pid"]], 90)
            r = c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=8, ignore_eos=True)
            assert len(r.token_ids) == 8
            poll("the restart in stats", lambda: restarts(c, "decode-0") == 1, 10)
            node_report = c.stats()["nodes"]["local"]
            assert node_report["last_exit"] == {"decode-0": "hung: killed"}  # the healthy roles were left alone
            assert sum(node_report["restarts"].values()) == 1
            wait_all_blocks_free(c, timeout=10)
        assert not pools_of(victim["pid"])
    finally:
        assert node.stop() == 0


def liveness_file(pid: int) -> str:
    """The liveness file the launcher gave a child (wire/liveness.py), from its environment."""
    env = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
    return env[LIVENESS_ENV.encode()].decode()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    from pdserve.launch import HANG_KILL_GRACE_S, Child, Launcher, NodePlan

    alive = tmp_path / "x.alive"
    launcher = Launcher(NodePlan(hang_timeout_s=0.5))
    child = Child("x", [], str(alive))  # its loop touched once, then hung, deaf to SIGTERM
    child.proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   f"open({str(alive)!r}, 'a').close(); print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        child.proc.stdout.readline()  # it ignores SIGTERM from here on
        t0 = time.monotonic()
        poll("the kill", lambda: launcher._check_liveness(child, time.monotonic()) or child.proc.poll() is not None, 10 + HANG_KILL_GRACE_S)
        assert child.proc.returncode == -signal.SIGKILL and time.monotonic() - t0 >= 0.5 + HANG_KILL_GRACE_S
        launcher._note_exit(child, time.monotonic())
        assert child.last_exit == "hung: killed" and child.restart_at is not None
    finally:
        child.proc.kill()
        child.proc.wait()


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
def test_a_crash_looping_worker_is_retried_with_back_off_while_the_node_serves(model_dir, tmp_path):
    node = Node(model_dir, tmp_path, "--decode", "2", "--engine-arg=--kv-cache-mb=16")
    looping = "decode --worker-id local-decode-1"  # its command line, as ps shows it
    try:
        killed = []
        for _ in range(4):  # killed as soon as it starts: four crashes at start in a row
            pid = poll("decode-1's next start", lambda: (p := node.child(looping)) not in (None, *killed) and p, 30)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        err = poll("the fourth restart's line", lambda: "restarting in 8.0 s" in (e := node.stderr()) and e, 10)
        for n, delay in ((2, 2), (3, 4), (4, 8)):  # one line each time, the delay doubling
            assert (f"decode-1 (pid {killed[n - 1]}) exited with signal SIGKILL; restarting in {delay:.1f} s "
                    f"(restart {n}; {n} exits in a row within 60 s of their start)") in err
        assert f"decode-1 (pid {killed[0]}) exited with signal SIGKILL; restarting in 1.0 s (restart 1)" in err
        with Client(node.clients, timeout=30) as c:  # the other roles serve meanwhile
            poll("prefill-0 and decode-0", lambda: {"local-prefill-0", "local-decode-0"} <= {w["id"] for w in c.stats()["workers"]}, 90)
            assert node.proc.poll() is None
            r = c.generate(token_ids=prompts(1)[0], temperature=0, max_tokens=8, ignore_eos=True)
            assert len(r.token_ids) == 8
            assert restarts(c, "decode-1") >= 3 and c.stats()["nodes"]["local"]["last_exit"]["decode-1"] == "signal SIGKILL"
            # still retried: after its 8 s back-off it starts again and joins
            poll("decode-1's return", lambda: "local-decode-1" in {w["id"] for w in c.stats()["workers"]}, 90)
            poll("the fourth restart in stats", lambda: restarts(c, "decode-1") == 4, 10)
            wait_all_blocks_free(c, timeout=10)
    finally:
        assert node.stop() == 0


@pytest.mark.timeout(120)  # measured 24 s on a loaded machine
def test_sigterm_during_a_back_off_at_start_stops_the_node_at_once(model_dir, tmp_path):
    """A role crash-looping while the launch starts (the launcher waits for every worker) puts it
    in an 8 s back-off; SIGTERM then stops the node in well under that (Kubernetes sends SIGKILL
    30 s after SIGTERM, and a back-off can be 30 s), with no child left."""
    node = Node(model_dir, tmp_path, "--decode", "2", "--engine-arg=--kv-cache-mb=16")
    looping = "decode --worker-id local-decode-1"
    killed = []
    for _ in range(4):  # killed as soon as it starts, before it registers: the launcher is still starting
        pid = poll("decode-1's next start", lambda: (p := node.child(looping)) not in (None, *killed) and p, 60)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    poll("the 8 s back-off", lambda: "restarting in 8.0 s" in node.stderr(), 10)
    assert "ready" not in node.stderr().lower().split("restarting in 8.0 s")[0].splitlines()[-1]
    kids = [int(x) for x in subprocess.run(["ps", "-o", "pid=", "--ppid", str(node.proc.pid)], capture_output=True,
                                           text=True).stdout.split()]
    t0 = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0
    took = time.monotonic() - t0
    assert took < 5.0, f"the stop took {took:.1f} s: it waited out the back-off"
    assert all(not os.path.exists(f"/proc/{k}") for k in kids), "children left behind"


def test_the_backoff_doubles_from_1_s_up_to_30_s():
    from pdserve.launch import backoff

    assert [backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize("flag, error", [
    ("--engine-arg=--no-such-flag=1", "prefill-0: No such option '--no-such-flag'."),  # checked before anything starts
    ("--model=/no/such/model", "model path does not exist: /no/such/model"),
])
def test_a_configuration_error_stops_the_launch_before_anything_starts(model_dir, tmp_path, flag, error):
    node = Node(model_dir, tmp_path, flag)
    assert node.proc.wait(timeout=60) == 1
    assert f"pdserve launch: {error}\npdserve launch: stopping" in node.stderr()
    assert not glob.glob(str(tmp_path / "*.log"))  # no role was started


def test_a_value_a_worker_rejects_at_its_first_start_stops_the_node(model_dir, tmp_path):
    node = Node(model_dir, tmp_path, "--engine-arg=--max-num-seqs=0")  # parses; the worker's config refuses it
    assert node.proc.wait(timeout=120) == 1
    err = node.stderr()
    assert "cannot start with this configuration (exit status 2); the end of its log:" in err
    assert "max_num_seqs and max_num_batched_tokens must be >= 1" in err  # the worker's own message, printed
    assert "restarting" not in err


def test_a_decode_pool_larger_than_dev_shm_stops_the_node_at_once(model_dir, tmp_path):
    from pdserve.kvtransfer.pool import shm_free_bytes

    too_big = shm_free_bytes() // 2**20 + 1024
    # the decode worker alone: a prefill worker would allocate that much private memory
    node = Node(model_dir, tmp_path, "--prefill", "0", "--decode", "1", f"--engine-arg=--kv-cache-mb={too_big}")
    code = node.proc.wait(timeout=180)
    assert code == 1
    assert "decode-0" in node.stderr() and "cannot start with this configuration (exit status 78" in node.stderr()
    assert "MiB free: lower --kv-cache-mb" in (tmp_path / "decode-0.log").read_text()
