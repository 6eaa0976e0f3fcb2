"""`pdserve launch --ray ADDRESS`: the same service on a Ray cluster. The coordinator (and the
HTTP gateway) run on this node, as `pdserve launch` runs them; every worker is a Ray actor
(`WorkerActor`) placed by resources (--ray-num-cpus / --ray-num-gpus, spread over the nodes),
and the count of each role follows the traffic between --min-replicas and --max-replicas.

Why an actor runs a one-worker Launcher (pdserve/launch.py) rather than the worker loop itself:
the worker stays the process it is everywhere else (`python -m pdserve worker ...`, the command
line the launcher builds, its own signals, torch threads and shared-memory pool), and a crash or
a hang is restarted on its node by the supervision `pdserve launch` already has. Ray restarts the
actor (max_restarts=-1), and so its worker under the same worker id, when the actor dies or its
node is lost; the coordinator drops the silent worker and places its requests again, as for any
dead worker. The per-launch worker secret and the CurveZMQ keys travel as actor arguments (msgspec
JSON bytes; Ray's own control plane pickles its actor class and calls, inside the cluster): each
actor writes them into private files on its own node, never a path another node cannot see.

Lifecycle: connect to Ray -> start the coordinators (one per model, pdserve/launch.py's
`NodePlan.models`) and the gateway with a Launcher of no workers (the secret it writes is read
here to hand on) -> start each model's initial workers (the launch's counts, within the limits),
each actor's worker pointed at its model's coordinator and path, and wait until they are
registered -> every TICK_S: tend the local roles (restarts), and for each model (a `ModelPool`:
its actors and its own Autoscaler, the same --min-replicas/--max-replicas for every model) read
its coordinator's stats and `Autoscaler.decide` (a role whose phase load is
over 1 (coordinator/planner.py's phase_loads, in the stats), that has requests queued on its
workers or waiting for a worker, gets one more worker, one at a time; a worker idle for
--downscale-delay-s is removed while its role has more than its minimum) -> on SIGINT/SIGTERM
stop every actor's worker (SIGTERM), then the local roles, and leave the cluster.
With --min-replicas 0 every model's coordinator runs with --cold-start-s (coordinator/server.py
hold_for_cold_start): a request that finds no worker waits for the one the autoscaler starts.
Not built: tensor parallel workers under --ray (their ranks would need a placement group) and a
cluster TOML with --ray; both are refused with "not supported".
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import msgspec
import ray

from pdserve.common.errors import NotSupportedError
from pdserve.launch import ROLES, ConfigError, Launcher, ModelPlan, NodePlan
from pdserve.ray_config import Autoscaler, RayConfig, Replica

TICK_S = 1.0  # the autoscaler's period
STOP_GRACE_S = 15.0  # a removed worker's SIGTERM -> its actor killed
NAMESPACE = "pdserve"  # the Ray namespace of every launch's actors (named `actor_name`)
PRIVATE_OBJECT_STORE = 256 * 2**20  # a private cluster's object store: the workers pass nothing through it
DEFAULT_COLD_START_S = 30.0  # --cold-start-s given to the coordinator with --min-replicas 0, unless set


def actor_name(worker_addr: str, replica: str) -> str:
    """A worker actor's name in NAMESPACE: unique per coordinator (its worker address)."""
    return f"{worker_addr}/{replica}"


def _write_tree(files: dict[str, bytes]) -> str:
    """A private copy (0700 directory, 0600 files) of a directory handed over as {relative path: bytes}."""
    root = tempfile.mkdtemp(prefix="pdserve-keys-")
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return root


def _read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


class ActorArgs(msgspec.Struct):
    """What a worker actor is started with, as msgspec JSON bytes (Ray carries them opaque: no
    pickle of ours on its wire): its one-worker plan, the launch's secret and keys directory."""

    plan: NodePlan
    secret: str | None
    keys: dict[str, bytes] | None
    log_dir: str | None


@ray.remote(max_restarts=-1, max_task_retries=0)
class WorkerActor:
    """One worker on whichever node Ray placed it: a Launcher of that one worker, supervising it
    from a thread of this actor (its child dies with this process: PDEATHSIG)."""

    def __init__(self, args: bytes):
        from pdserve.wire.security import is_loopback, write_secret

        a = msgspec.json.decode(args, type=ActorArgs)
        plan, secret, keys, log_dir = a.plan, a.secret, a.keys, a.log_dir
        self.node_id = ray.get_runtime_context().get_node_id()
        here = "127.0.0.1" if is_loopback(plan.worker_addr) else ray.util.get_node_ip_address()  # its KV port, where decode workers reach it
        plan = dataclasses.replace(plan, kv_bind_host=here, keys=_write_tree(keys) if keys else None)
        self.launcher = Launcher(plan, log_dir and os.path.join(log_dir, plan.name))  # every actor's child is `ROLE-0`
        self.launcher.secret_file = write_secret(secret) if secret else None
        self.stopped: list = []
        self.error: str | None = None
        threading.Thread(target=self._supervise, daemon=True).start()

    def _supervise(self) -> None:
        try:
            self.launcher.start()
            self.launcher.supervise(self.stopped)
        except Exception as e:  # ConfigError: this node cannot run it (the model path missing here, ...)
            self.error = f"{type(e).__name__}: {e}"
            print(f"pdserve ray worker {self.launcher.plan.name}: {self.error}", file=sys.stderr, flush=True)

    def where(self) -> bytes:
        """JSON: its node, its worker's pid, and the error that stopped it (null while it serves)."""
        procs = self.launcher.procs
        return msgspec.json.encode({"node_id": self.node_id, "pid": procs[0][1].pid if procs else None, "error": self.error})

    def stop(self) -> None:
        self.stopped.append(1)
        self.launcher.stop()
        if self.launcher.plan.keys:
            shutil.rmtree(self.launcher.plan.keys, ignore_errors=True)


@dataclasses.dataclass
class ModelPool:
    """One model's worker actors and its autoscaler (each model's coordinator has its own stats)."""

    model: ModelPlan
    scaler: Autoscaler
    replicas: list[Replica] = dataclasses.field(default_factory=list)


class RayLaunch:
    """The driver: the local roles, each model's worker actors (`Replica`s) and the autoscaler's loop."""

    def __init__(self, plan: NodePlan, cfg: RayConfig, log_dir: str | None = None, usage_error=None):
        check_supported(plan)
        counts = {role: getattr(plan, role) for role in ROLES if getattr(plan, role) or role in cfg.named_roles()}
        self.plan, self.cfg, self.log_dir = plan, cfg, log_dir
        limits = cfg.replica_limits(counts)  # the same for every model
        serving = {role for role, n in counts.items() if n}
        self.pools = [ModelPool(m, Autoscaler(limits, cfg.downscale_delay_s, serving)) for m in plan.models]
        self.initial = {role: min(max(n, limits[role][0]), limits[role][1]) for role, n in counts.items()}
        local = dataclasses.replace(plan, prefill=0, decode=0, colocated=0)
        if any(lo == 0 for lo, _ in limits.values()):
            local.coordinator_args = with_cold_start(plan.coordinator_args)
        self.local = Launcher(local, log_dir, usage_error)
        self.serial = 0
        self.secret: str | None = None
        self.keys: dict[str, bytes] | None = None

    @property
    def replicas(self) -> list[Replica]:
        """Every model's worker actors."""
        return [r for pool in self.pools for r in pool.replicas]

    def connect(self) -> None:
        address = self.cfg.address
        if address == "auto":
            try:
                ray.init(address="auto", namespace=NAMESPACE, log_to_driver=self.log_dir is None)
                return
            except ConnectionError:  # no cluster on this machine: a private one
                address = None
        private = {"include_dashboard": False, "object_store_memory": PRIVATE_OBJECT_STORE} if address is None else {}
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=self.log_dir is None, **private)
        except (ConnectionError, ValueError) as e:  # an address nothing answers at, or not an address
            raise ConfigError(f"--ray {self.cfg.address}: {e}") from None

    def start(self) -> None:
        """Join the cluster, start every model's coordinator and the gateway here, then each model's initial workers (ConfigError
        if a role cannot start)."""
        from pdserve.wire.security import read_secret

        handler = signal.getsignal(signal.SIGTERM)
        self.connect()
        signal.signal(signal.SIGTERM, handler)  # ray.init sets its own: SIGTERM stops the launch as Ctrl-C does
        self.local.start()
        self.secret = read_secret(self.local.secret_file)
        self.keys = _read_tree(self.plan.keys) if self.plan.keys else None
        for pool in self.pools:
            for role, n in self.initial.items():
                for _ in range(n):
                    self.add(pool, role, "the launch's count")

    def add(self, pool: ModelPool, role: str, why: str) -> Replica:
        """A worker actor of `role` for the pool's model: its one-worker plan points at that model's coordinator and path."""
        self.serial += 1
        m = pool.model
        name = f"{m.prefix}ray{self.serial}"
        plan = dataclasses.replace(self.plan, coordinator=False, gateway=False, worker_secret=False, name=name, keys=None,
                                   model=m.path, served_model_name=m.name, client_addr=m.client_addr, worker_addr=m.worker_addr,
                                   more_models=[], threads=self.plan.threads or max(1, int(self.cfg.num_cpus)),
                                   **{r: int(r == role) for r in ROLES})
        actor = WorkerActor.options(name=actor_name(m.worker_addr, name), num_cpus=self.cfg.num_cpus,
                                    num_gpus=self.cfg.num_gpus, scheduling_strategy="SPREAD").remote(
                                        msgspec.json.encode(ActorArgs(plan, self.secret, self.keys, self.log_dir)))
        rep = Replica(name, role, actor, time.monotonic())
        pool.replicas.append(rep)
        print(f"pdserve launch: ray: adding {role} worker {rep.worker_id}: {why}", file=sys.stderr, flush=True)
        return rep

    def remove(self, pool: ModelPool, rep: Replica) -> None:
        why = (f"idle for {self.cfg.downscale_delay_s:g} s" if rep.registered is not None else
               f"not registered {pool.scaler.register_timeout_s:g} s after it was asked for (its actor's log says why)")
        print(f"pdserve launch: ray: removing {rep.role} worker {rep.worker_id}: {why}", file=sys.stderr, flush=True)
        pool.replicas.remove(rep)
        stop_actors([rep])

    def tick(self, clients: list) -> None:
        """One pass: the local roles tended; for each model (`clients`: one per model's coordinator), registrations noted
        and its autoscaler's decisions made."""
        from pdserve_client.library import ClientError

        self.local.tend(clients)
        for pool, client in zip(self.pools, clients):
            try:
                stats = client.stats(timeout=2.0)
            except ClientError:
                continue  # this coordinator restarts: next tick
            self.scale(pool, stats)

    def scale(self, pool: ModelPool, stats: dict) -> None:
        """One model's autoscaler on its coordinator's stats: registrations logged, workers added and removed."""
        was = {r.name for r in pool.replicas if r.registered is None}
        add, remove = pool.scaler.decide(stats, pool.replicas, time.monotonic())
        for r in pool.replicas:
            if r.name in was and r.registered is not None:
                print(f"pdserve launch: ray: {r.role} worker {r.worker_id} registered {r.registered - r.asked:.1f} s after it was "
                      f"asked for", file=sys.stderr, flush=True)
        for role, why in add:
            self.add(pool, role, why)
        for rep in remove:
            self.remove(pool, rep)

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Block until the initial workers are registered (and the gateway answers); returns the stats."""
        stats = self.local.wait_ready(timeout)
        deadline = time.monotonic() + timeout
        clients = self.local.clients()
        try:
            while any(r.registered is None for r in self.replicas):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers not registered after {timeout:.0f}s: "
                                       + ", ".join(r.worker_id for r in self.replicas if r.registered is None))
                self.tick(clients)
                time.sleep(0.2)
            return clients[0].stats(timeout=2.0) if self.replicas else stats
        finally:
            for c in clients:
                c.close()

    def supervise(self, stop: list) -> None:
        """The autoscaler's loop, until `stop` holds something."""
        clients = self.local.clients()
        try:
            while not stop:
                self.tick(clients)
                time.sleep(TICK_S)
        finally:
            for c in clients:
                c.close()

    def served_names(self) -> list[str]:
        """Each model's name as clients send it (the ready line's)."""
        return self.local.served_names()

    def worker_ids(self, m: ModelPlan) -> set[str]:
        """The ids of model m's workers (its actors') now (the ready line's)."""
        return {r.worker_id for pool in self.pools if pool.model == m for r in pool.replicas}

    def stop(self) -> None:
        stop_actors(self.replicas)
        for pool in self.pools:
            pool.replicas.clear()
        self.local.stop()
        ray.shutdown()

    def run_forever(self, on_ready=None) -> int:
        """Launcher's lifecycle (signals, start, ready, supervise, stop; 1 on a configuration error) with these steps."""
        return Launcher.run_forever(self, on_ready)


def stop_actors(replicas: list[Replica]) -> None:
    """Stop their workers (SIGTERM, as `pdserve launch` stops a role), then kill the actors for good."""
    try:
        ray.get([r.actor.stop.remote() for r in replicas], timeout=STOP_GRACE_S)
    except Exception:  # noqa: BLE001 (a node gone, a worker that hangs, ...): killed below all the same
        pass
    for r in replicas:
        ray.kill(r.actor, no_restart=True)


def with_cold_start(args: list[str]) -> list[str]:
    """The coordinator's arguments with --cold-start-s DEFAULT_COLD_START_S unless one above 0 is given."""
    if "--cold-start-s" in args:
        i = args.index("--cold-start-s")
        if float(args[i + 1]) > 0:
            return args
        args = args[:i] + args[i + 2:]
    return [*args, "--cold-start-s", f"{DEFAULT_COLD_START_S:g}"]


def check_supported(plan: NodePlan) -> None:
    """NotSupportedError for what --ray does not run yet."""
    args = plan.engine_args + plan.prefill_args + plan.decode_args
    for i, a in enumerate(args[:-1]):
        if a == "--tensor-parallel-size" and args[i + 1].isdigit() and int(args[i + 1]) > 1:  # a bad value: the worker's own flag check
            raise NotSupportedError("tensor parallel workers under --ray are not supported (their ranks would need a Ray "
                                    "placement group); run them with `pdserve launch` on their node")
    if not plan.coordinator:
        raise NotSupportedError("--ray with a cluster TOML (--config/--node) is not supported: --ray places every worker itself")
