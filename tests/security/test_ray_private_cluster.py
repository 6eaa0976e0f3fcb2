"""`pdserve launch --ray auto` where no Ray cluster runs on this machine starts a private one, run as a user runs it (the
CLI in a subprocess, with --keys and --api-key, the tiny model): once it serves, every TCP socket listening in a process
it started (its process tree: the coordinator, the gateway, Ray's gcs_server, raylet, agents and the worker actors with
their workers) binds loopback; Ray's processes run with token authentication and a token only their owner reads; Ray's
control store (gcs_server's memory) holds none of the secret keys nor the API key; a decode worker's keys directory
holds the server and worker keypairs and no client keypair; no worker is given the API key. After SIGTERM the launch's
directory (the token, the role keys) is gone. Skipped where ray is not installed or another Ray cluster runs here (auto
would join it)."""
import base64
import importlib.util
import ipaddress
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import zmq.auth

from pdserve.wire.security import keygen
from pdserve_client.library import Client, ClientError
from tests.helpers import free_port, save_tiny_served_model

pytestmark = [pytest.mark.ray, pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'pdserve[ray]')"),
              pytest.mark.timeout(300)]

API_KEY = "sk-test-private-ray-0123456789abcdef"
RAY_COMPONENTS = ("gcs_server", "raylet")  # listen in any Ray cluster: seen, or the search for listeners is wrong


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def read(path: str, mode: str = "rb"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours
        return b"" if "b" in mode else ""


def cmdline(pid: int) -> list[str]:
    return [a.decode(errors="replace") for a in read(f"/proc/{pid}/cmdline").split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    pairs = (e.decode(errors="replace").partition("=") for e in read(f"/proc/{pid}/environ").split(b"\0") if e)
    return {k: v for k, _, v in pairs}


def descendants(root: int) -> set[int]:
    """root and every process below it now (/proc/PID/stat's parent)."""
    parent = {}
    for pid in pids():
        stat_line = read(f"/proc/{pid}/stat", "r")
        if stat_line:
            parent[pid] = int(stat_line.rsplit(")", 1)[1].split()[1])
    out, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in out} - out
        out |= more
        grew = bool(more)
    return out


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the process holds (its fds' inodes in its /proc/net/tcp and tcp6)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        for line in read(f"/proc/{pid}/net/{table}", "r").splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host (little) order
                out.append((socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(hexport, 16)))
    return out


def on_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def memory_holds(pid: int, needles: list[bytes]) -> list[bytes]:
    """The needles found in the process's readable memory (/proc/PID/mem, region by region)."""
    found = set()
    longest = max(len(n) for n in needles)
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            cols = line.split()
            if "r" not in cols[1] or (len(cols) > 5 and cols[5] in ("[vvar]", "[vsyscall]", "[vvar_vclock]")):
                continue
            start, end = (int(x, 16) for x in cols[0].split("-"))
            tail = b""
            for at in range(start, end, 16 << 20):
                try:
                    mem.seek(at)
                    chunk = tail + mem.read(min(16 << 20, end - at))
                except (OSError, ValueError, OverflowError):
                    break
                found.update(n for n in needles if n in chunk)
                tail = chunk[-longest:]
    return sorted(found)


def other_ray_cluster_here() -> bool:
    return any(os.path.basename(cmdline(p)[0]) == "gcs_server" for p in pids() if cmdline(p))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


class PrivateLaunch:
    """`pdserve launch --ray auto --keys K --api-key A` in a subprocess, its stderr in a file."""

    def __init__(self, model_dir, tmp_path):
        self.keys = str(keygen(str(tmp_path / "keys")))
        self.clients = f"tcp://127.0.0.1:{free_port()}"
        self.err = tmp_path / "launch.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir), "--clients", self.clients,
             "--workers", f"tcp://127.0.0.1:{free_port()}", "--http-port", str(free_port()), "--threads", "1", "--no-slo",
             "--log-dir", str(tmp_path / "logs"), "--ray", "auto", "--ray-num-cpus", "0.25", "--keys", self.keys,
             "--api-key", API_KEY, "--engine-arg=--kv-cache-mb=8", "--decode-tp", "2"],  # TP ranks: listeners and keys too
            stderr=open(self.err, "w"))

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_serving(self, timeout: float = 240.0) -> None:
        """Until the prefill and the decode worker are registered (or skip: auto joined a cluster started meanwhile)."""
        deadline = time.monotonic() + timeout
        with Client(self.clients, timeout=2, keys=self.keys) as c:
            while True:
                assert self.proc.poll() is None, f"launch exited: {self.stderr()}"
                if "joined the Ray cluster" in self.stderr():
                    pytest.skip("another Ray cluster started on this machine meanwhile: --ray auto joined it")
                try:
                    if {w["role"] for w in c.stats(timeout=1)["workers"]} == {"prefill", "decode"}:
                        return
                except ClientError:
                    pass
                assert time.monotonic() < deadline, f"not serving within {timeout:g} s: {self.stderr()}"
                time.sleep(0.5)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=90)


@pytest.fixture(scope="module")
def launch(model_dir, tmp_path_factory):
    if other_ray_cluster_here():
        pytest.skip("a Ray cluster runs on this machine: --ray auto would join it")
    n = PrivateLaunch(model_dir, tmp_path_factory.mktemp("ray-private"))
    try:
        n.wait_serving()
        yield n
    finally:
        if n.proc.poll() is None:
            n.stop()


def tree(launch) -> dict[int, str]:
    """pid -> program name of every process the launch started, live now."""
    return {p: os.path.basename(cmdline(p)[0]) for p in descendants(launch.proc.pid) if cmdline(p)}


def test_auto_starts_a_private_cluster_on_loopback(launch):
    assert "started a private one on 127.0.0.1 (token authentication on, no dashboard)" in launch.stderr(), launch.stderr()


def test_a_tensor_parallel_worker_runs_as_one_actor_with_its_ranks_beside_it(launch):
    """--decode-tp 2 under --ray: the decode worker reports TP 2 and its second rank runs as its child on the same node."""
    with Client(launch.clients, timeout=5, keys=launch.keys) as c:
        decode = next(w for w in c.stats()["workers"] if w["role"] == "decode")
    assert decode["engine"]["tensor_parallel_size"] == 2, decode
    ranks = [p for p in descendants(decode["pid"]) if "pdserve.worker.tp_ranks" in " ".join(cmdline(p))]
    assert len(ranks) == 1, ranks


def test_every_listener_of_the_launch_and_its_ray_cluster_binds_loopback(launch):
    procs = tree(launch)
    listening = {(p, name): tcp_listeners(p) for p, name in procs.items()}
    listening = {k: v for k, v in listening.items() if v}
    names = {name for _, name in listening}
    for component in RAY_COMPONENTS:
        assert component in names, (component, listening)
    assert any("coordinator" in cmdline(p) for p, _ in listening) and any("gateway" in cmdline(p) for p, _ in listening), listening
    exposed = {k: [a for a in v if not on_loopback(a[0])] for k, v in listening.items()}
    assert not {k: v for k, v in exposed.items() if v}, listening


def test_ray_runs_with_a_private_token(launch):
    gcs = next(p for p, name in tree(launch).items() if name == "gcs_server")
    env = environ(gcs)
    assert env.get("RAY_AUTH_MODE") == "token" and "RAY_AUTH_TOKEN" not in env, env.get("RAY_AUTH_MODE")
    token = env["RAY_AUTH_TOKEN_PATH"]
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(token)).st_mode) == 0o700
    assert len(open(token).read()) >= 32


def worker_args(launch) -> dict[str, list[str]]:
    """role -> the command line of the launch's worker of that role."""
    out = {}
    for p in descendants(launch.proc.pid):
        args = cmdline(p)
        if "worker" in args and "--role" in args:
            out[args[args.index("--role") + 1]] = args
    return out


def test_workers_get_their_roles_keys_and_no_api_key(launch):
    workers = worker_args(launch)
    assert set(workers) == {"prefill", "decode"}, workers
    for role, args in workers.items():
        assert API_KEY not in " ".join(args) and "--api-key" not in args, role
        keys = args[args.index("--keys") + 1]
        assert keys != launch.keys, role
        files = {os.path.relpath(os.path.join(d, f), keys) for d, _, fs in os.walk(keys) for f in fs}
        assert files == {"server.key", "server.key_secret", "worker.key", "worker.key_secret", "authorized-workers/worker.key"}, files


def test_the_actors_restart_counts_reach_the_coordinator(launch):
    """Reported by the driver (an actor holds no client key to send them itself)."""
    deadline = time.monotonic() + 30
    with Client(launch.clients, timeout=5, keys=launch.keys) as c:
        while not {"ray1", "ray2"} <= set(c.stats()["nodes"]):
            assert time.monotonic() < deadline, c.stats()["nodes"]
            time.sleep(0.5)
        assert c.stats()["nodes"]["ray2"]["restarts"] == {"decode-0": 0}, c.stats()["nodes"]


def test_rays_control_store_holds_no_key_nor_api_key(launch):
    needles = [API_KEY.encode()]
    for name in ("client", "server", "worker"):
        path = os.path.join(launch.keys, f"{name}.key_secret")
        data = open(path, "rb").read()
        needles += [zmq.auth.load_certificate(path)[1], base64.b64encode(data)]
    gcs = next(p for p, name in tree(launch).items() if name == "gcs_server")
    assert memory_holds(gcs, needles) == []


def test_stop_removes_the_launchs_directory(launch):
    gcs = next(p for p, name in tree(launch).items() if name == "gcs_server")
    launch_dir = os.path.dirname(environ(gcs)["RAY_AUTH_TOKEN_PATH"])
    role_keys = [args[args.index("--keys") + 1] for args in worker_args(launch).values()]
    assert all(k.startswith(launch_dir + os.sep) for k in role_keys), (launch_dir, role_keys)
    assert launch.stop() == 0, launch.stderr()
    assert not os.path.exists(launch_dir)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{gcs}") and b"(zombie)" not in read(f"/proc/{gcs}/status"):
        assert time.monotonic() < deadline, "the private cluster's gcs_server outlived the launch"
        time.sleep(0.2)
