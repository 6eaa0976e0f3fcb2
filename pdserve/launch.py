"""The per-node launcher (`pdserve launch`): start every role this node runs, wait until all
are registered, print where to connect, and stop them all cleanly.

Lifecycle: build a `NodePlan` (from flags, or from a cluster TOML and a node name) -> start
the coordinator first if this node runs it, then the workers, each a child process of this
one (`python -m pdserve worker --role ROLE ...`: a worker the coordinator can move to another
role; with `fixed_roles`, `pdserve prefill` / `pdserve decode`; killed by the kernel if the
launcher dies: PDEATHSIG) ->
poll the coordinator's stats until the expected workers are registered (and, with the HTTP
gateway, until it answers /health) -> print the endpoints -> supervise. Each coordinator is told the
ids of the workers this launch starts for it (`--expect-worker`): its stats (`startup`) and so the
gateway's /health/ready say not ready until each has registered once, so a probe never sees a node
ready with part of its topology (`--decode 2` with one decode worker up). Before anything starts,
the configuration is checked: the model path, and every child's flags parsed by its own
command (an unknown flag or a bad value stops the launch with click's message). A child that
exits on its own is restarted with the same arguments (same worker id, same core-share slot)
after a back-off, with one log line naming its exit status; the shared-memory KV pool it left is
unlinked first. Before any worker starts (and sizes its KV from /dev/shm's free space), every pool
of this user whose worker is gone is removed (`sweep_left_pools`: a SIGKILL of a whole node's
process group leaves them, nothing of the node being left to unlink them; kvtransfer/pool_files.py).
The back-off is RESTART_BACKOFF_S, doubled for each further exit in a row within CRASH_WINDOW_S
of its start, up to MAX_BACKOFF_S: a crash-looping role is retried for as long as the node runs
while the other roles serve. A child whose main loop stops touching its liveness
file (wire/liveness.py) for `hang_timeout_s` is hung: SIGTERM (with SIGCONT, for a stopped
one), SIGKILL HANG_KILL_GRACE_S later, then restarted like a crash (last exit "hung: killed").
The clock starts at its loop's first touch, so loading a model or a start-up profile is never
taken for a hang. Only a configuration error stops the node (exit status 1, the child's last
log lines printed): a role exiting at its first start with EX_CONFIG (78: a configuration it
can never start with, e.g. a KV pool larger than /dev/shm) or click's usage status (2: a value
its config rejects). Restart counts and last exits reach `pdserve stats` (`nodes`) through a
NodeReport the launcher sends the coordinator every REPORT_S. SIGINT/SIGTERM stops everything at once (also while the
launcher waits for its roles to start or out a restart's back-off: StopRequested): SIGTERM to each child,
SIGKILL after a grace period, and every shared-memory KV pool a child left is unlinked.
Without --keys, a launch that runs its coordinator (not a cluster TOML's node) makes CurveZMQ keys
of its own (wire/security.py `write_launch_keys`: loopback only, in this user's 0700 run
directory, found by the same user's clients by the coordinator's port) and hands them to every
role (restarted ones too) as --keys; the launcher removes them at stop.
Several models (`--model PATH[=NAME]` repeated) run as one coordinator per model, each with the
same worker layout and its own ports (the first model's --clients and --workers ports, plus 2 for
each model after it), and one gateway that routes each request to its model's coordinator by its
`model` field (gateway/models.py); the node's workers of every model share its cores.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field

from pdserve.common.errors import EX_CONFIG, ModelLoadError
from pdserve.common.model_path import served_name
from pdserve.gateway.config import API_KEY_ENV, GatewayConfig, ModelRoute, check_http_bind
from pdserve.kvtransfer.pool_files import sweep_dead_pools
from pdserve.wire.liveness import LIVENESS_ENV
from pdserve_client.errors import InvalidRequestError
from pdserve_client.keys import InsecureBindError

RESTART_BACKOFF_S = 1.0  # the first restart's delay; doubled for each further crash at start, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
CRASH_WINDOW_S = 60.0  # an exit this soon after the start counts as a crash at start
# A loop pass's longest legitimate wait: an engine step of max_num_batched_tokens (default 2048)
# tokens, a decode worker's stall cap (10 s), a prefill hand-off's KV timeout (10 s, touched
# between hand-offs). A big model on the CPU with a larger token budget may need more.
HANG_TIMEOUT_S = 60.0
HANG_KILL_GRACE_S = 5.0  # a hung child's SIGTERM -> SIGKILL
USAGE_EXIT = 2  # click's UsageError.exit_code: a flag value the role's config rejects
REPORT_S = 2.0  # NodeReport period (restart counts in `pdserve stats`; a restarted coordinator learns them again)
ROLES = ("prefill", "decode", "colocated")
WORKER_COMMANDS = ("worker", "prefill", "decode")  # the `pdserve COMMAND` of a worker child
TP_FLAGS = ("--tensor-parallel-size", "-tp")
PORTS_PER_MODEL = 2  # model i's coordinator listens on the first model's client and worker ports + 2i


class ConfigError(RuntimeError):
    """The node cannot run with this configuration: the launch stops, the message printed."""


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived while the launcher waited (for its roles to start, or out a
    restart's back-off): the wait ends at once and the launch stops."""


def backoff(crashes: int) -> float:
    """The delay before a restart after `crashes` exits in a row soon after their start."""
    return min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** max(0, crashes - 1))


def port_plus(addr: str, k: int) -> str:
    """A tcp address with its port k higher."""
    head, _, port = addr.rpartition(":")
    if not (addr.startswith("tcp://") and port.isdigit()):
        raise ConfigError(f"several models need tcp://HOST:PORT coordinator addresses (each model's ports follow), got {addr!r}")
    return f"{head}:{int(port) + k}"


def flag_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value the last of `names` gives in a command line (`--flag value` or `--flag=value`),
    as click reads a repeated option; None if none is there."""
    value = None
    for i, a in enumerate(args):
        name, eq, given = a.partition("=")
        if name in names:
            value = given if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def plan_gpus(workers: list[tuple[str, list[str]]], visible: int, base: int = 0) -> dict[str, str]:
    """Each worker's `--device cuda:K`, for those of `workers` ((name, command line), in start
    order) whose device is `cuda` without an index: GPUs of their own, one per tensor-parallel
    rank, in order from cuda:`base` on (a worker's ranks then take K, K+1, ...: runtime.tp.rank_devices).
    A worker on `cuda:K` was placed by hand and is left alone. Where the `visible` GPUs are too few
    for one set each, every worker starts at cuda:`base` and they share them (the default 1 + 1
    launch on a one-GPU machine, as vLLM's users run one); ConfigError, before anything starts,
    when one worker's ranks need more GPUs than there are from `base` on."""
    spans, at = {}, base  # name -> (its first GPU, its GPU count)
    for name, args in workers:
        if flag_value(args, ("--device",)) != "cuda":
            continue
        tp = flag_value(args, TP_FLAGS) or "1"
        spans[name] = (at, int(tp) if tp.isdigit() else 1)  # a bad size: the worker's own flag check says so
        at += spans[name][1]
    if spans and at > visible:
        widest = max(n for _, n in spans.values())
        if widest > visible - base:
            which = ", ".join(f"{name}: {n} GPU{'s' if n > 1 else ''}" for name, (_, n) in spans.items())
            raise ConfigError(f"a worker on --device cuda needs {widest} GPUs from cuda:{base} on ({which}) but this node "
                              f"sees {visible} (CUDA_VISIBLE_DEVICES chooses which; --base-gpu-id {base} is the first one used)")
        print(f"pdserve launch: the workers on --device cuda need {at - base} GPUs for one set each, this node sees {visible}: "
              f"they share them from cuda:{base} on", file=sys.stderr, flush=True)
        return {name: f"cuda:{base}" for name in spans}
    return {name: f"cuda:{k}" for name, (k, _) in spans.items()}


def visible_gpus() -> int:
    """The GPUs this node's workers will see (CUDA_VISIBLE_DEVICES applies)."""
    import torch  # only for workers on CUDA: the launcher itself does not need torch

    return torch.cuda.device_count()


@dataclass
class ModelPlan:
    """One model of a launch: its weights (None: the default model), the name clients send as
    `model` (None: its file or directory's name), and its coordinator's addresses. `prefix` starts
    its roles' names and worker ids: "" for the first model (as with one model), "model1-" ..."""

    path: str | None
    name: str | None
    client_addr: str
    worker_addr: str
    prefix: str = ""


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
    decode_args: list[str] = field(default_factory=list)  # passed to decode and colocated workers only
    threads: int | None = None
    name: str = "local"
    coordinator_args: list[str] = field(default_factory=list)  # passed to the coordinator
    gateway_args: list[str] = field(default_factory=list)  # passed to the gateway (request limits)
    gateway: bool = False  # the OpenAI HTTP gateway (`pdserve launch` turns it on beside the coordinator)
    http_host: str = GatewayConfig.host
    http_port: int = GatewayConfig.port
    api_key: str | None = None
    keys: str | None = None  # CurveZMQ keys directory, passed to every role
    insecure: bool = False  # allow binds beyond loopback without keys
    served_model_name: str | None = None  # the gateway's model name
    more_models: list[tuple[str, str | None]] = field(default_factory=list)  # (path, name or None) of each model after the first
    launch_keys: bool = True  # without keys: this launch makes CurveZMQ keys of its own (loopback only) for every role
    hang_timeout_s: float = HANG_TIMEOUT_S  # a child whose loop has not run for this long is killed and restarted
    # False: every worker is `pdserve worker --role ROLE` (worker/any_role.py), which the coordinator may move to another
    # role; True: dedicated prefill workers (`pdserve prefill`, private pool) and `pdserve decode` workers
    fixed_roles: bool = False
    base_gpu_id: int = 0  # workers on `--device cuda` take GPUs of their own from this one on (plan_gpus; SGLang's flag)

    @property
    def num_workers(self) -> int:
        """Workers of each model."""
        return self.prefill + self.decode + self.colocated

    @property
    def models(self) -> list[ModelPlan]:
        """Every model this node serves: the first on client_addr / worker_addr, model i on their ports + 2i."""
        first = ModelPlan(self.model, self.served_model_name, self.client_addr, self.worker_addr)
        plans = [first] + [ModelPlan(path, name, port_plus(self.client_addr, PORTS_PER_MODEL * i),
                                     port_plus(self.worker_addr, PORTS_PER_MODEL * i), f"model{i}-")
                           for i, (path, name) in enumerate(self.more_models, 1)]
        addrs = [a for m in plans for a in (m.client_addr, m.worker_addr)]
        if len(set(addrs)) < len(addrs):
            raise ConfigError(f"the models' coordinator addresses collide ({', '.join(addrs)}): model i takes the --clients "
                              f"and --workers ports + {PORTS_PER_MODEL}i, so neither may be the other's + {PORTS_PER_MODEL}i")
        return plans

    @property
    def http_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.http_host, self.http_host)  # a wildcard bind answers on loopback
        return f"http://[{host}]:{self.http_port}" if ":" in host else f"http://{host}:{self.http_port}"


def plan_from_toml(path: str, node: str) -> NodePlan:
    """Cluster file: [cluster] (coordinator_host, client_port, worker_port, model, dtype,
    kv_backend, kv_cache_mb, fixed_roles) and [nodes.NAME] (host, coordinator, prefill, decode, colocated,
    base_gpu_id)."""
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
        worker_addr=f"tcp://{host}:{cluster.get('worker_port', 5556)}", launch_keys=False,  # workers of other nodes: the operator's keys
        kv_bind_host=n.get("host", "127.0.0.1"), model=cluster.get("model"), kv_backend=cluster.get("kv_backend", "auto"),
        base_gpu_id=int(n.get("base_gpu_id", 0)),
        engine_args=engine_args, threads=n.get("threads"), name=node,
        keys=cluster.get("keys"), insecure=bool(cluster.get("insecure", False)), fixed_roles=bool(cluster.get("fixed_roles", False)),
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
    """Remove the shared-memory KV pool a dead child left (kvtransfer.pool_files names it after its pid)."""
    sweep_dead_pools(pid)


def sweep_left_pools() -> None:
    """Remove the KV pools of workers that are gone (a whole node SIGKILLed leaves them: nothing
    else unlinks them), before any worker sizes its KV from /dev/shm's free space."""
    removed = sweep_dead_pools()
    if removed:
        print(f"pdserve launch: removed {len(removed)} KV pools ({sum(n for _, n in removed) / 2**20:.1f} MiB) whose workers "
              f"are gone: {', '.join(os.path.basename(p) for p, _ in removed)}", file=sys.stderr, flush=True)


@dataclass
class Child:
    """One role of this node, across its restarts."""

    name: str
    args: list[str]
    alive_path: str = ""  # its liveness file (wire/liveness.py)
    env: dict[str, str] = field(default_factory=dict)  # added to its environment (secrets: never on its command line)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    crashes: int = 0  # exits in a row that came within CRASH_WINDOW_S of their start
    restart_at: float | None = None  # set while it waits out its back-off
    last_exit: str = ""
    alive_mtime: int | None = None  # the liveness file's mtime last seen (None: its loop has not run yet)
    alive_at: float = 0.0  # when that mtime was first seen
    kill_at: float | None = None  # hung: SIGKILL at this time unless it has exited


class Launcher:
    def __init__(self, plan: NodePlan, log_dir: str | None = None, usage_error=None):
        self.plan = plan
        self.log_dir = log_dir
        self.usage_error = usage_error  # (role, args) -> click's message if `pdserve ROLE ARGS` would not parse, else None
        self.children: list[Child] = []
        self.stopping = False
        self.stop_requested = False  # SIGINT/SIGTERM arrived: every wait loop ends at its next check_children
        self.core_share: str | None = None  # runtime.cores flags, when the workers share the cores
        self.own_keys: str | None = None  # the keys this launch made for itself (wire/security.py write_launch_keys; removed at stop)
        self.alive_dir: str | None = None  # the children's liveness files
        self.next_report = 0.0  # when the next NodeReport is due (tend)
        # model prefix -> the worker ids its coordinator waits for before it says ready (None: this node's, worker_ids)
        self.expected: dict[str, set[str]] | None = None

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(role name, its current process) for every role."""
        return [(c.name, c.proc) for c in self.children if c.proc is not None]

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        """Plan a child; `start` starts them all once their flags are checked."""
        self.children.append(Child(name, args, os.path.join(self.alive_dir, f"{name}.alive"), env or {}))

    def _start_child(self, child: Child) -> None:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{child.name}.log"), "ab")
        if os.path.exists(child.alive_path):
            os.unlink(child.alive_path)  # the new process's loop makes it again
        try:
            child.proc = subprocess.Popen([sys.executable, "-P", "-m", "pdserve", *child.args], stdout=out,
                                          stderr=subprocess.STDOUT if out else None, preexec_fn=_die_with_parent,
                                          env={**os.environ, **child.env, LIVENESS_ENV: child.alive_path})
        finally:
            if out is not None:
                out.close()  # the child holds its own copy
        child.started = time.monotonic()
        child.restart_at = child.alive_mtime = child.kill_at = None

    def served_names(self) -> list[str]:
        """Each model's name as clients send it; ConfigError if a model path is missing or two
        models share a name."""
        try:
            names = [m.name or served_name(m.path) for m in self.plan.models]
        except ModelLoadError as e:  # missing, or the default model not installed
            raise ConfigError(str(e)) from None
        if len(set(names)) < len(names):
            raise ConfigError(f"two models are named alike ({', '.join(names)}): name each one with --model PATH=NAME")
        return names

    def validate(self) -> None:
        """ConfigError if a model path is missing or a child's flags do not parse (`usage_error`:
        the CLI parses them with the role's own command, without running it)."""
        if self.plan.coordinator or self.plan.num_workers:
            self.served_names()
        if self.plan.gateway:
            try:
                check_http_bind(self.plan.http_host, self.plan.api_key)
            except InsecureBindError as e:
                raise ConfigError(str(e)) from None
        for child in self.children:
            error = self.usage_error and self.usage_error(child.args[0], child.args[1:])
            if error:
                raise ConfigError(f"{child.name}: {error}")

    def _worker_args(self, m: ModelPlan) -> list[str]:
        p = self.plan
        args = ["--coordinator", m.worker_addr, *p.engine_args]
        if m.path:
            args += ["--model", m.path]
        threads = p.threads or max(1, (os.cpu_count() or 1) // max(1, p.num_workers * len(p.models)))
        return args + ["--threads", str(threads)] + self._security_args()

    def _role_command(self, role: str) -> list[str]:
        """How a worker starting in `role` is started: `pdserve worker --role ROLE` (it can change
        role), or with fixed roles `pdserve prefill` / `pdserve decode [--colocated]`."""
        p = self.plan
        kv_bind = ["--kv-bind", f"tcp://{p.kv_bind_host}:*"]
        if not p.fixed_roles:
            return ["worker", *kv_bind, "--kv-backend", p.kv_backend, "--role", role]  # `ROLE --worker-id ID` in ps, as before
        if role == "prefill":
            return ["prefill", "--kv-backend", p.kv_backend]
        return ["decode", *kv_bind, *(["--colocated"] if role == "colocated" else [])]

    @property
    def keys(self) -> str | None:
        """The CurveZMQ keys every role of this node gets: the operator's (--keys), else the launch's own."""
        return self.plan.keys or self.own_keys

    def _security_args(self) -> list[str]:
        return (["--keys", self.keys] if self.keys else []) + (["--insecure"] if self.plan.insecure else [])

    def _gateway_args(self) -> list[str]:
        p = self.plan
        args = ["gateway", "--coordinator", p.client_addr, "--host", p.http_host, "--port", str(p.http_port)]
        args += ["--model", p.model] if p.model else []
        args += ["--served-model-name", p.served_model_name] if p.served_model_name else []
        more = zip(p.models[1:], self.served_names()[1:])
        args += [a for m, name in more for a in ("--more-model", ModelRoute(name, m.path, m.client_addr).spec())]
        return args + (["--keys", self.keys] if self.keys else []) + p.gateway_args  # the API key goes in its environment (ps shows argv)

    def _coordinator_args(self, m: ModelPlan) -> list[str]:
        p = self.plan
        args = ["coordinator", "--clients", m.client_addr, "--workers", m.worker_addr] + (["--model", m.path] if m.path else [])
        args += ["--served-model-name", m.name] if m.name else []  # its traces' and stats' name
        expected = self.worker_ids(m) if self.expected is None else self.expected.get(m.prefix, set())
        args += [a for wid in sorted(expected) for a in ("--expect-worker", wid)]  # not ready before they registered (stats `startup`)
        return args + p.coordinator_args + self._security_args()

    def worker_ids(self, m: ModelPlan) -> set[str]:
        """The ids of model m's workers on this node."""
        return {f"{self.plan.name}-{m.prefix}{role}-{i}" for role in ROLES for i in range(getattr(self.plan, role))}

    def start(self) -> None:
        """Check the configuration (ConfigError), then start every role: the coordinator first."""
        p = self.plan
        if p.num_workers:
            sweep_left_pools()
        self.alive_dir = tempfile.mkdtemp(prefix="pdserve-alive-")
        if p.launch_keys and not p.keys and p.coordinator:
            from pdserve.wire.security import write_launch_keys

            self.own_keys = write_launch_keys([m.client_addr for m in p.models])
        for m in p.models if p.coordinator else ():
            self._spawn(m.prefix + "coordinator", self._coordinator_args(m))
        if p.gateway:
            self._spawn("gateway", self._gateway_args(), {API_KEY_ENV: p.api_key} if p.api_key else None)
        # Without --threads the node's workers share its cores by who is busy (runtime.cores).
        if p.threads is None and p.num_workers:
            from pdserve.runtime.cores import create_share  # here: the launcher itself does not need torch

            self.core_share = create_share(p.num_workers * len(p.models))
        slots = iter(range(p.num_workers * len(p.models)))

        def share() -> list[str]:
            return ["--core-share", f"{self.core_share}:{next(slots)}"] if self.core_share else []

        for m in p.models:
            common = self._worker_args(m)
            for role in ROLES:
                for i in range(getattr(p, role)):
                    self._spawn(f"{m.prefix}{role}-{i}", [*self._role_command(role), "--worker-id", f"{p.name}-{m.prefix}{role}-{i}",
                                                          *common, *share(), *(p.prefill_args if role == "prefill" else p.decode_args)])
        self.validate()
        self.place_gpus()
        for child in self.children:
            self._start_child(child)

    def place_gpus(self) -> None:
        """Give each worker on `--device cuda` GPUs of its own (plan_gpus): prefill workers first,
        then decode and colocated ones, model after model; ConfigError if the node has too few."""
        workers = [c for c in self.children if c.args[0] in WORKER_COMMANDS]
        if not any(flag_value(c.args, ("--device",)) == "cuda" for c in workers):
            return
        devices = plan_gpus([(c.name, c.args) for c in workers], visible_gpus(), self.plan.base_gpu_id)
        for c in workers:
            if c.name in devices:
                c.args = [*c.args, "--device", devices[c.name]]  # the last --device is the one a worker takes

    def clients(self) -> list:
        """A LauncherLink to each model's coordinator (stats; NodeReport and DrainWorker with the worker keys;
        the caller closes them)."""
        from pdserve.launcher_link import LauncherLink

        return [LauncherLink(m.client_addr, m.worker_addr, self.keys) for m in self.plan.models]

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Block until this node's workers are registered with their coordinators; returns the first model's stats."""
        deadline = time.monotonic() + timeout
        clients = self.clients()
        try:
            ready = [self._wait_workers(m, client, clients, deadline, timeout) for m, client in zip(self.plan.models, clients)]
        finally:
            for c in clients:
                c.close()
        if self.plan.gateway:
            self.wait_gateway(deadline)
        return ready[0]

    def _wait_workers(self, m: ModelPlan, client, clients: list, deadline: float, timeout: float) -> dict:
        """Model m's coordinator's stats once its workers on this node are registered."""
        from pdserve_client.library import ClientError

        missing = mine = self.worker_ids(m)
        while time.monotonic() < deadline:
            self.tend(clients)  # a role crash-looping meanwhile shows in stats
            try:
                stats = client.stats(timeout=1.0)
            except ClientError:
                continue
            missing = mine - {w["id"] for w in stats["workers"]}
            if not missing:
                return stats
            time.sleep(0.2)
        raise TimeoutError(f"workers not registered after {timeout:.0f}s: {', '.join(sorted(missing)) or 'no coordinator answer'}")

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
        """Kill what hung, restart what exited (after its back-off); True if a role was
        restarted. Raises ConfigError when a role cannot start with its configuration."""
        now = time.monotonic()
        restarted = False
        if self.stop_requested:
            raise StopRequested("a stop was asked for")  # out of any wait (start-up, a back-off) at once
        for child in self.children:
            if self.stopping:
                return restarted
            if child.restart_at is None:
                if child.proc.poll() is not None:
                    self._note_exit(child, now)
                else:
                    self._check_liveness(child, now)
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._start_child(child)
                restarted = True
        return restarted

    def _check_liveness(self, child: Child, now: float) -> None:
        """A child whose liveness file's mtime has not changed for hang_timeout_s since its loop
        first touched it: SIGTERM (+SIGCONT), then SIGKILL after HANG_KILL_GRACE_S."""
        if child.kill_at is not None:
            if now >= child.kill_at:
                child.proc.kill()
            return
        try:
            mtime = os.stat(child.alive_path).st_mtime_ns
        except FileNotFoundError:
            return  # still starting: its loop has not run yet
        if mtime != child.alive_mtime:
            child.alive_mtime, child.alive_at = mtime, now
        elif now - child.alive_at > self.plan.hang_timeout_s:
            print(f"pdserve launch: {child.name} (pid {child.proc.pid}) hung: its loop has not run for {now - child.alive_at:.1f} s "
                  f"(--hang-timeout-s {self.plan.hang_timeout_s:g}); killing it (SIGKILL in {HANG_KILL_GRACE_S:g} s)",
                  file=sys.stderr, flush=True)
            child.proc.send_signal(signal.SIGTERM)
            child.proc.send_signal(signal.SIGCONT)  # a stopped child would never see the SIGTERM
            child.kill_at = now + HANG_KILL_GRACE_S

    def _note_exit(self, child: Child, now: float) -> None:
        code, pid = child.proc.returncode, child.proc.pid
        unlink_pool_of(pid)
        hung = child.kill_at is not None
        child.last_exit = "hung: killed" if hung else exit_status(code)
        if not hung and child.restarts == 0 and code in (EX_CONFIG, USAGE_EXIT):
            raise ConfigError(f"{child.name} (pid {pid}) cannot start with this configuration ({child.last_exit})"
                              + self._log_tail(child.name))
        child.crashes = child.crashes + 1 if now - child.started < CRASH_WINDOW_S else 1
        delay = backoff(child.crashes)
        child.restart_at = now + delay
        how = exit_status(code) + (" (hung: killed)" if hung else "")
        in_a_row = f"; {child.crashes} exits in a row within {CRASH_WINDOW_S:g} s of their start" if child.crashes > 1 else ""
        print(f"pdserve launch: {child.name} (pid {pid}) exited with {how}; restarting in {delay:.1f} s (restart {child.restarts + 1}"
              f"{in_a_row})", file=sys.stderr, flush=True)

    def _log_tail(self, name: str, lines: int = 8) -> str:
        """The last lines of a child's log, to print with its configuration error."""
        if not self.log_dir:
            return "; its error is above"
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                tail = f.read().decode(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return "; the end of its log:\n" + "\n".join(f"  {line}" for line in tail)

    def tend(self, clients: list) -> None:
        """check_children, and a NodeReport after a restart or every REPORT_S."""
        if (self.check_children() or time.monotonic() >= self.next_report) and clients:
            self.report(clients)
            self.next_report = time.monotonic() + REPORT_S

    def report(self, clients: list) -> None:
        """Tell each model's coordinator this node's restart counts (shown by `pdserve stats` under `nodes`; one the
        coordinator misses, down or restarting, the next report makes up)."""
        for client in clients:
            client.report_node(self.plan.name, {c.name: c.restarts for c in self.children},
                               {c.name: c.last_exit for c in self.children if c.last_exit})

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
        if self.own_keys:
            from pdserve.wire.security import remove_launch_keys

            remove_launch_keys(self.own_keys)
        if self.alive_dir:
            shutil.rmtree(self.alive_dir, ignore_errors=True)

    def run_forever(self, on_ready=None) -> int:
        stop = []
        def on_signal(*_):
            stop.append(1)
            self.stop_requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            self.start()
            try:
                stats = self.wait_ready() if self.plan.coordinator or self.plan.num_workers else None
                if on_ready:
                    on_ready(stats)
            except TimeoutError as e:  # a role that keeps crashing, or a slow start: go on restarting it
                print(f"pdserve launch: {e}; serving with the roles that are up", file=sys.stderr, flush=True)
            self.supervise(stop)
            return 0
        except StopRequested:  # while starting or waiting: a stop never waits out a back-off or a slow start
            return 0
        except RuntimeError as e:  # ConfigError
            print(f"pdserve launch: {e}\npdserve launch: stopping", file=sys.stderr)
            return 1
        finally:
            self.stop()

    def supervise(self, stop: list) -> None:
        """Restart exited roles and report restart counts until `stop` holds something."""
        clients = self.clients() if self.plan.coordinator or self.plan.num_workers else []
        try:
            while not stop:
                self.tend(clients)
                time.sleep(0.2)
        finally:
            for c in clients:
                c.close()
