"""The per-node launcher (`pdserve launch`): start every role this node runs, wait until all
are registered, print where to connect, and stop them all cleanly.

Lifecycle: build a `NodePlan` (from flags, or from a cluster TOML and a node name) -> start
the coordinator first if this node runs it, then the workers, each a child process of this
one (`python -m pdserve ROLE ...`, killed by the kernel if the launcher dies: PDEATHSIG) ->
poll the coordinator's stats until the expected workers are registered (and, with the HTTP
gateway, until it answers /health) -> print the endpoints -> supervise. A child that exits on
its own is restarted with the same arguments (same worker id, same core-share slot) after a
back-off, with one log line naming its exit status; the shared-memory KV pool it left is
unlinked first. The node gives up (stops everything, exit status 1) only when a role keeps
crashing at start: CRASH_LOOP exits in a row, each within CRASH_WINDOW_S of its start, or one
exit with EX_CONFIG (78: a configuration it can never start with, e.g. a KV pool larger than
/dev/shm). Restart counts reach `pdserve stats` (`nodes`) through a NodeReport the launcher
sends the coordinator every REPORT_S. SIGINT/SIGTERM stops everything: SIGTERM to each child,
SIGKILL after a grace period, and every shared-memory KV pool a child left is unlinked.
Without CurveZMQ keys, a launch that runs every role itself (not a cluster TOML's node) writes a
per-launch worker secret into a 0600 file (wire/security.py) and hands its path to the
coordinator and the workers (restarted ones too); it is removed at stop.
"""
from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field

from runtime.errors import EX_CONFIG, InvalidRequestError

RESTART_BACKOFF_S = 0.5  # the first restart's delay; doubled for each further crash at start, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 10.0
CRASH_WINDOW_S = 60.0  # an exit this soon after the start counts as a crash at start
CRASH_LOOP = 5  # this many crashes at start in a row stop the node
REPORT_S = 2.0  # NodeReport period (restart counts in `pdserve stats`; a restarted coordinator learns them again)


@dataclass
class NodePlan:
    coordinator: bool = True
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    client_addr: str = "tcp://127.0.0.1:5555"
    worker_addr: str = "tcp://127.0.0.1:5556"
    kv_bind_host: str = "127.0.0.1"
    model: str | None = None
    kv_backend: str = "auto"
    engine_args: list[str] = field(default_factory=list)  # passed to every worker
    prefill_args: list[str] = field(default_factory=list)  # passed to prefill workers only
    threads: int | None = None
    name: str = "local"
    coordinator_args: list[str] = field(default_factory=list)  # passed to the coordinator
    gateway_args: list[str] = field(default_factory=list)  # passed to the gateway (request limits)
    gateway: bool = False  # the OpenAI HTTP gateway (`pdserve launch` turns it on beside the coordinator)
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    api_key: str | None = None
    keys: str | None = None  # CurveZMQ keys directory, passed to every role
    insecure: bool = False  # allow binds beyond loopback without keys
    served_model_name: str | None = None  # the gateway's model name
    worker_secret: bool = True  # without keys: authenticate this launch's workers with a per-launch secret

    @property
    def security_args(self) -> list[str]:
        return (["--keys", self.keys] if self.keys else []) + (["--insecure"] if self.insecure else [])

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def http_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.http_host, self.http_host)  # a wildcard bind answers on loopback
        return f"http://[{host}]:{self.http_port}" if ":" in host else f"http://{host}:{self.http_port}"


def plan_from_toml(path: str, node: str) -> NodePlan:
    """Cluster file: [cluster] (coordinator_host, client_port, worker_port, model, dtype,
    kv_backend, kv_cache_mb) and [nodes.NAME] (host, coordinator, prefill, decode, colocated)."""
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    cluster = doc.get("cluster", {})
    nodes = doc.get("nodes", {})
    if node not in nodes:
        raise InvalidRequestError(f"node {node!r} is not in {path} (nodes: {', '.join(nodes) or 'none'})")
    n = nodes[node]
    host = cluster.get("coordinator_host", "127.0.0.1")
    engine_args = []
    for key in ("dtype", "kv_cache_mb", "block_size", "max_num_seqs", "max_batched_tokens"):
        if key in cluster:
            engine_args += [f"--{key.replace('_', '-')}", str(cluster[key])]
    return NodePlan(
        coordinator=bool(n.get("coordinator", False)),
        prefill=int(n.get("prefill", 0)), decode=int(n.get("decode", 0)), colocated=int(n.get("colocated", 0)),
        client_addr=f"tcp://{host}:{cluster.get('client_port', 5555)}",
        worker_addr=f"tcp://{host}:{cluster.get('worker_port', 5556)}", worker_secret=False,  # workers of other nodes: keys
        kv_bind_host=n.get("host", "127.0.0.1"), model=cluster.get("model"), kv_backend=cluster.get("kv_backend", "auto"),
        engine_args=engine_args, threads=n.get("threads"), name=node,
        keys=cluster.get("keys"), insecure=bool(cluster.get("insecure", False)),
    )


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_status(code: int) -> str:
    """A Popen return code in words: "exit status 1" or "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def unlink_pool_of(pid: int) -> None:
    """Remove the shared-memory KV pool a dead child left (kvtransfer.pool names it after its pid)."""
    for path in glob.glob(f"/dev/shm/pdserve-kv-{pid}"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass
class Child:
    """One role of this node, across its restarts."""

    name: str
    args: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    crashes: int = 0  # exits in a row that came within CRASH_WINDOW_S of their start
    restart_at: float | None = None  # set while it waits out its back-off
    last_exit: str = ""


class Launcher:
    def __init__(self, plan: NodePlan, log_dir: str | None = None):
        self.plan = plan
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.stopping = False
        self.core_share: str | None = None  # runtime.cores flags, when the workers share the cores
        self.secret_file: str | None = None  # the per-launch worker secret (wire/security.py)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(role name, its current process) for every role."""
        return [(c.name, c.proc) for c in self.children]

    def _spawn(self, name: str, args: list[str]) -> None:
        child = Child(name, args)
        self.children.append(child)
        self._start_child(child)

    def _start_child(self, child: Child) -> None:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{child.name}.log"), "ab")
        try:
            child.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *child.args], stdout=out,
                                          stderr=subprocess.STDOUT if out else None, preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()  # the child holds its own copy
        child.started = time.monotonic()
        child.restart_at = None

    def _worker_args(self) -> list[str]:
        p = self.plan
        args = ["--coordinator", p.worker_addr, *p.engine_args]
        if p.model:
            args += ["--model", p.model]
        threads = p.threads or max(1, (os.cpu_count() or 1) // max(1, p.num_workers))
        return args + ["--threads", str(threads)] + p.security_args + self._secret_args()

    def _secret_args(self) -> list[str]:
        return ["--worker-secret-file", self.secret_file] if self.secret_file else []

    def _gateway_args(self) -> list[str]:
        p = self.plan
        args = ["gateway", "--coordinator", p.client_addr, "--host", p.http_host, "--port", str(p.http_port)]
        args += ["--model", p.model] if p.model else []
        args += ["--served-model-name", p.served_model_name] if p.served_model_name else []
        return args + (["--api-key", p.api_key] if p.api_key else []) + (["--keys", p.keys] if p.keys else []) + p.gateway_args

    def start(self) -> None:
        p = self.plan
        if p.worker_secret and not p.keys and p.coordinator:
            from wire.security import write_secret

            self.secret_file = write_secret()
        if p.coordinator:
            args = ["coordinator", "--clients", p.client_addr, "--workers", p.worker_addr]
            self._spawn("coordinator", args + (["--model", p.model] if p.model else []) + p.coordinator_args + p.security_args
                        + self._secret_args())
        if p.gateway:
            self._spawn("gateway", self._gateway_args())
        common = self._worker_args()
        kv_bind = f"tcp://{p.kv_bind_host}:*"
        # Without --threads the node's workers share its cores by who is busy (runtime.cores).
        if p.threads is None and p.num_workers:
            from runtime.cores import create_share  # here: the launcher itself does not need torch

            self.core_share = create_share(p.num_workers)
        slots = iter(range(p.num_workers))

        def share() -> list[str]:
            return ["--core-share", f"{self.core_share}:{next(slots)}"] if self.core_share else []

        for i in range(p.prefill):
            self._spawn(f"prefill-{i}", ["prefill", "--worker-id", f"{p.name}-prefill-{i}", "--kv-backend", p.kv_backend, *common,
                                         *share(), *p.prefill_args])
        for i in range(p.decode):
            self._spawn(f"decode-{i}", ["decode", "--worker-id", f"{p.name}-decode-{i}", "--kv-bind", kv_bind, *common, *share()])
        for i in range(p.colocated):
            self._spawn(f"colocated-{i}", ["decode", "--colocated", "--worker-id", f"{p.name}-colocated-{i}", "--kv-bind", kv_bind,
                                           *common, *share()])

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Block until this node's workers are registered with the coordinator; returns its stats."""
        from client.library import Client, ClientError

        deadline = time.monotonic() + timeout
        mine = {f"{self.plan.name}-{role}-{i}" for role, n in (("prefill", self.plan.prefill), ("decode", self.plan.decode),
                                                              ("colocated", self.plan.colocated)) for i in range(n)}
        with Client(self.plan.client_addr, timeout=2.0, keys=self.plan.keys) as client:
            while time.monotonic() < deadline:
                self.check_children()
                try:
                    stats = client.stats(timeout=1.0)
                except ClientError:
                    continue
                if mine <= {w["id"] for w in stats["workers"]}:
                    if self.plan.gateway:
                        self.wait_gateway(deadline)
                    return stats
                time.sleep(0.2)
        raise TimeoutError(f"workers not registered after {timeout:.0f}s")

    def wait_gateway(self, deadline: float) -> None:
        """Block until the gateway answers /health (503 counts: it answers while workers are missing)."""
        import urllib.error
        import urllib.request

        while time.monotonic() < deadline:
            self.check_children()
            try:
                urllib.request.urlopen(f"{self.plan.http_url}/health", timeout=2.0).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"the gateway did not answer at {self.plan.http_url}/health in time")

    def check_children(self) -> bool:
        """Restart what exited (after its back-off); True if a role was restarted. Raises
        RuntimeError when a role keeps crashing at start (see the module docstring)."""
        now = time.monotonic()
        restarted = False
        for child in self.children:
            if self.stopping:
                return restarted
            if child.restart_at is None and child.proc.poll() is not None:
                self._note_exit(child, now)
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._start_child(child)
                restarted = True
        return restarted

    def _note_exit(self, child: Child, now: float) -> None:
        code, pid = child.proc.returncode, child.proc.pid
        unlink_pool_of(pid)
        child.last_exit = exit_status(code)
        child.crashes = child.crashes + 1 if now - child.started < CRASH_WINDOW_S else 1
        if code == EX_CONFIG:
            raise RuntimeError(f"{child.name} (pid {pid}) cannot start with this configuration ({child.last_exit}; see its log)")
        if child.crashes >= CRASH_LOOP:
            raise RuntimeError(f"{child.name} (pid {pid}) exited with {child.last_exit}, its {child.crashes}th crash in a row "
                               f"within {CRASH_WINDOW_S:g} s of starting; giving up")
        delay = min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (child.crashes - 1))
        child.restart_at = now + delay
        print(f"pdserve launch: {child.name} (pid {pid}) exited with {child.last_exit}; restarting in {delay:.1f} s "
              f"(restart {child.restarts + 1})", file=sys.stderr, flush=True)

    def report(self, client) -> None:
        """Tell the coordinator this node's restart counts (shown by `pdserve stats` under `nodes`)."""
        from client.library import ClientError

        try:
            client.report_node(self.plan.name, {c.name: c.restarts for c in self.children},
                               {c.name: c.last_exit for c in self.children if c.last_exit})
        except ClientError:
            pass  # the coordinator is down (or restarting): the next report gets through

    def stop(self, grace: float = 10.0) -> None:
        self.stopping = True
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a stopped child would never see the SIGTERM
        deadline = time.monotonic() + grace
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for _, proc in self.procs:  # pools of children that could not clean up (SIGKILL)
            unlink_pool_of(proc.pid)
        if self.core_share and os.path.exists(self.core_share):
            os.unlink(self.core_share)
        if self.secret_file and os.path.exists(self.secret_file):
            os.unlink(self.secret_file)
            os.rmdir(os.path.dirname(self.secret_file))

    def run_forever(self, on_ready=None) -> int:
        stop = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.append(1))
        try:
            self.start()
            stats = self.wait_ready() if self.plan.coordinator or self.plan.num_workers else None
            if on_ready:
                on_ready(stats)
            self.supervise(stop)
            return 0
        except (RuntimeError, TimeoutError) as e:
            print(f"pdserve launch: {e}; stopping", file=sys.stderr)
            return 1
        finally:
            self.stop()

    def supervise(self, stop: list) -> None:
        """Restart exited roles and report restart counts until `stop` holds something."""
        client = None
        if self.plan.coordinator or self.plan.num_workers:
            from client.library import Client

            client = Client(self.plan.client_addr, timeout=2.0, keys=self.plan.keys)
        try:
            next_report = 0.0
            while not stop:
                if (self.check_children() or time.monotonic() >= next_report) and client is not None:
                    self.report(client)
                    next_report = time.monotonic() + REPORT_S
                time.sleep(0.2)
        finally:
            if client is not None:
                client.close()
