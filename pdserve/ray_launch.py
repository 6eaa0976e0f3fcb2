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
dead worker.

Credentials (docs/security.md, Ray): each actor gets only what its role's worker needs
(`role_key_files`: the worker keypair and the server's public key; the KV port's server keypair
and the admitted worker keys unless it is a fixed prefill worker; never the client keypair, the
API key or the coordinator's and gateway's flags: an actor's restart counts, which its launcher
would send to the client port, reach the coordinator through the driver, `report_restarts`). `--ray auto` without a cluster on this machine
starts a private one (`start_private_cluster`): one node whose every Ray process binds loopback,
Ray's token authentication on with a per-launch token, no dashboard; its actors run on this node,
so they are handed *paths* into the launch's 0700 directory (`LaunchFiles`: the token, each role's
keys: the operator's --keys or the launch's own), and no key material enters Ray's control store (which also
records the driver's command line: without --api-key's value, `hide_secret_flags_from_ray`). On a cluster
given by address (or one `ray start` runs here) the actors may run on nodes that cannot see this
one's files: the role's key files travel as actor arguments (msgspec JSON
bytes; Ray's own control plane pickles its actor class and calls, inside the cluster, and keeps
the arguments to restart the actor: protect that cluster with Ray's token authentication), and
each actor writes them into a 0700 directory named by its pid (`own_copy_dir`), removed at its stop;
any such directory whose process is gone (an actor restarted, a launch killed) is removed when the
next launch or actor starts on that node (`remove_stale_copies`).

Lifecycle: connect to Ray (or start the private cluster) -> start the coordinators (one per model, pdserve/launch.py's
`NodePlan.models`) and the gateway with a Launcher of no workers (the keys it makes without --keys
are handed on from it) -> start each model's initial workers (the launch's counts, within the limits),
each actor's worker pointed at its model's coordinator and path, and wait until they are
registered -> every TICK_S: tend the local roles (restarts), and for each model (a `ModelPool`:
its actors and its own Autoscaler, within that model's --min-replicas/--max-replicas: N, ROLE=N or MODEL:ROLE=N) read
its coordinator's stats, report its actors' restart counts (asked every REPORT_S), and
`Autoscaler.decide` (a role whose phase load is
over 1 (coordinator/planner.py's phase_loads, in the stats), that has requests queued on its
workers or waiting for a worker, gets one more worker, one at a time; once the others' room (their max_num_seqs)
has held all its role has in flight for --downscale-delay-s (Ray Serve's rule), its least busy worker is removed
while its role has more than its minimum, requests in flight on it or not: drained first (DrainWorker:
its coordinator places nothing more there, what is in flight there completes), stopped once the
stats show nothing in flight on it, so that no request placed there in its last seconds is placed again) -> on SIGINT/SIGTERM
stop every actor's worker (SIGTERM), then the local roles, and leave the cluster (a private one
stops with it; its directory is removed).
With --min-replicas 0 every model's coordinator runs with cold starts on (--cold-start-s, the estimate
until one is measured: coordinator/cold_start.py): a request that finds no worker waits for the one the
autoscaler starts, bounded (--cold-start-timeout-s, --max-held-requests, --max-held-kb).
Tensor-parallel workers (--prefill-tp / --decode-tp N): a worker's ranks are its own child
processes on its node, sharing its shared-memory KV pool (worker/tp_ranks.py), so its N slots must
be on one node; its actor asks for N times --ray-num-cpus / --ray-num-gpus (`tp_size`), which Ray
grants only on a node that has them all (what a STRICT_PACK placement group of N bundles would
reserve, without a group to create and remove), and with GPUs sets the actor's
CUDA_VISIBLE_DEVICES to its N devices, which the ranks take as cuda:0..N-1.
Not built: a cluster TOML with --ray (refused with "not supported").
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import threading
import time

import msgspec
import ray

from pdserve.common.errors import NotSupportedError
from pdserve.launch import REPORT_S, ROLES, ConfigError, Launcher, ModelPlan, NodePlan
from pdserve.ray_config import Autoscaler, RayConfig, Replica
from pdserve.ray_credentials import LaunchFiles, own_copy_dir, role_key_files, write_keys

TICK_S = 1.0  # the autoscaler's period
SUPERVISE_S = 0.2  # an actor's check of its worker (pdserve launch's)
STOP_GRACE_S = 15.0  # a removed worker's SIGTERM -> its actor killed
NAMESPACE = "pdserve"  # the Ray namespace of every launch's actors (named `actor_name`)
PRIVATE_OBJECT_STORE = 256 * 2**20  # a private cluster's object store: the workers pass nothing through it
DEFAULT_COLD_START_S = 30.0  # --cold-start-s given to the coordinator with --min-replicas 0, unless set
LOOPBACK_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes the loopback address as its node's (ray_constants)


def actor_name(worker_addr: str, replica: str) -> str:
    """A worker actor's name in NAMESPACE: unique per coordinator (its worker address)."""
    return f"{worker_addr}/{replica}"


class ActorArgs(msgspec.Struct):
    """What a worker actor is started with, as msgspec JSON bytes (Ray carries them opaque: no
    pickle of ours on its wire), kept by Ray to restart it: its one-worker plan and its worker's
    credentials, either a path on this node (a private cluster: `plan.keys`, its role's keys
    directory) or, for a cluster whose nodes cannot see this one's files, the material itself
    (`key_files`: role_key_files)."""

    plan: NodePlan
    log_dir: str | None
    key_files: dict[str, bytes] | None = None


@ray.remote(max_restarts=-1, max_task_retries=0)
class WorkerActor:
    """One worker on whichever node Ray placed it: a Launcher of that one worker, supervising it
    from a thread of this actor (its child dies with this process: PDEATHSIG)."""

    def __init__(self, args: bytes):
        from pdserve.wire.security import is_loopback

        a = msgspec.json.decode(args, type=ActorArgs)
        plan = a.plan
        self.copy = None  # its directory of the material it was handed (removed at stop, or when a later start finds it stale)
        if a.key_files:
            self.copy = own_copy_dir()
            plan = dataclasses.replace(plan, keys=write_keys(self.copy, a.key_files))
        self.node_id = ray.get_runtime_context().get_node_id()
        here = "127.0.0.1" if is_loopback(plan.worker_addr) else ray.util.get_node_ip_address()  # its KV port, where decode workers reach it
        plan = dataclasses.replace(plan, kv_bind_host=here)
        self.launcher = Launcher(plan, a.log_dir and os.path.join(a.log_dir, plan.name))  # every actor's child is `ROLE-0`
        self.stopped: list = []
        self.error: str | None = None
        threading.Thread(target=self._supervise, daemon=True).start()

    def _supervise(self) -> None:
        """Start its worker and tend it (restarts, hangs) until stopped. Its restart counts reach the coordinator through
        the driver (`restarts`), not from here: a report goes to the client port, and the actor holds no client key."""
        try:
            self.launcher.start()
            while not self.stopped:
                self.launcher.tend([])
                time.sleep(SUPERVISE_S)
        except Exception as e:  # ConfigError: this node cannot run it (the model path missing here, ...)
            self.error = f"{type(e).__name__}: {e}"
            print(f"pdserve ray worker {self.launcher.plan.name}: {self.error}", file=sys.stderr, flush=True)

    def where(self) -> bytes:
        """JSON: its node, its worker's pid, and the error that stopped it (null while it serves)."""
        procs = self.launcher.procs
        return msgspec.json.encode({"node_id": self.node_id, "pid": procs[0][1].pid if procs else None, "error": self.error})

    def restarts(self) -> bytes:
        """JSON: its worker's restart count and last exit by role name (a NodeReport's, pdserve/launch.py `report`)."""
        children = self.launcher.children
        return msgspec.json.encode({"restarts": {c.name: c.restarts for c in children},
                                    "last_exit": {c.name: c.last_exit for c in children if c.last_exit}})

    def stop(self) -> None:
        self.stopped.append(1)
        self.launcher.stop()
        if self.copy:
            shutil.rmtree(self.copy, ignore_errors=True)


@dataclasses.dataclass
class ModelPool:
    """One model's worker actors and its autoscaler (each model's coordinator has its own stats)."""

    model: ModelPlan
    scaler: Autoscaler
    initial: dict[str, int] = dataclasses.field(default_factory=dict)  # role -> workers started with (the launch's count within its limits)
    replicas: list[Replica] = dataclasses.field(default_factory=list)
    asked: dict = dataclasses.field(default_factory=dict)  # replica name -> its pending `restarts` call
    next_ask: float = 0.0  # when its actors are next asked for their restarts (monotonic)


class RayLaunch:
    """The driver: the local roles, each model's worker actors (`Replica`s) and the autoscaler's loop."""

    def __init__(self, plan: NodePlan, cfg: RayConfig, log_dir: str | None = None, usage_error=None):
        check_supported(plan)
        counts = {role: getattr(plan, role) for role in ROLES if getattr(plan, role) or role in cfg.named_roles()}
        self.plan, self.cfg, self.log_dir = plan, cfg, log_dir
        local = dataclasses.replace(plan, prefill=0, decode=0, colocated=0)
        self.local = Launcher(local, log_dir, usage_error)
        limits = cfg.replica_limits(counts, self.local.served_names())  # model -> role -> (min, max)
        serving = {role for role, n in counts.items() if n}
        self.pools = [ModelPool(m, Autoscaler(lim, cfg.downscale_delay_s, serving), initial={
                          role: min(max(n, lim[role][0]), lim[role][1]) for role, n in counts.items()})
                      for m, lim in zip(plan.models, limits.values())]
        if any(lo == 0 for lim in limits.values() for lo, _ in lim.values()):
            local.coordinator_args = with_cold_start(plan.coordinator_args)  # every model's coordinator (one may idle at zero)
        # no --expect-worker: an actor that does not register is replaced under another id (Autoscaler.register_timeout_s),
        # so its coordinator is ready by roles (a decode worker, or cold starts on) and `wait_ready` waits for the initial actors
        self.local.expected = {}
        self.serial = 0
        self.files: LaunchFiles | None = None  # a private cluster's directory (its actors are handed paths into it)

    @property
    def replicas(self) -> list[Replica]:
        """Every model's worker actors."""
        return [r for pool in self.pools for r in pool.replicas]

    def connect(self) -> None:
        """Join the cluster --ray names, or with `auto` and none on this machine start a private one."""
        address = self.cfg.address
        hide_secret_flags_from_ray()
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=self.log_dir is None)
        except ConnectionError as e:
            if address != "auto":
                raise ConfigError(f"--ray {address}: {e}") from None
            self.files = LaunchFiles()  # no cluster on this machine: a private one
            start_private_cluster(self.files.write_token(), self.log_dir is None)
            print("pdserve launch: ray: no Ray cluster on this machine: started a private one on "
                  f"{ray.util.get_node_ip_address()} (token authentication on, no dashboard)", file=sys.stderr, flush=True)
            return
        except ValueError as e:  # not an address
            raise ConfigError(f"--ray {address}: {e}") from None
        print(f"pdserve launch: ray: joined the Ray cluster at {address}", file=sys.stderr, flush=True)
        if not token_auth_on():
            print("pdserve launch: ray: warning: the cluster runs without Ray's token authentication: whoever reaches it can run "
                  "code in it and read the worker actors' arguments, their keys (docs/security.md, Ray)", file=sys.stderr, flush=True)

    def start(self) -> None:
        """Join the cluster, start every model's coordinator and the gateway here, then each model's initial workers (ConfigError
        if a role cannot start)."""
        handler = signal.getsignal(signal.SIGTERM)
        self.connect()
        signal.signal(signal.SIGTERM, handler)  # ray.init sets its own: SIGTERM stops the launch as Ctrl-C does
        self.local.start()
        for pool in self.pools:
            for role, n in pool.initial.items():
                for _ in range(n):
                    self.add(pool, role, "the launch's count")

    def add(self, pool: ModelPool, role: str, why: str) -> Replica:
        """A worker actor of `role` for the pool's model: its one-worker plan points at that model's coordinator and path."""
        self.serial += 1
        m = pool.model
        name = f"{m.prefix}ray{self.serial}"
        tp = tp_size(self.plan, role)  # a TP worker's ranks run beside it: its actor holds their slots too
        actor = WorkerActor.options(name=actor_name(m.worker_addr, name), num_cpus=self.cfg.num_cpus * tp,
                                    num_gpus=self.cfg.num_gpus * tp, scheduling_strategy="SPREAD").remote(self.actor_args(m, role, name))
        rep = Replica(name, role, actor, time.monotonic())
        pool.replicas.append(rep)
        print(f"pdserve launch: ray: adding {role} worker {rep.worker_id}: {why}", file=sys.stderr, flush=True)
        return rep

    def actor_args(self, m: ModelPlan, role: str, name: str) -> bytes:
        """The arguments of the actor `name` running one `role` worker of model m: its one-worker plan (none of the
        coordinator's, the gateway's or the API key's flags) and only the credentials its role needs (ActorArgs)."""
        p = self.plan
        plan = dataclasses.replace(p, coordinator=False, gateway=False, launch_keys=False, name=name, keys=None, api_key=None,
                                   coordinator_args=[], gateway_args=[], model=m.path, served_model_name=m.name,
                                   client_addr=m.client_addr, worker_addr=m.worker_addr, more_models=[],
                                   threads=p.threads or max(1, int(self.cfg.num_cpus)), **{r: int(r == role) for r in ROLES})
        keys = self.local.keys  # the operator's, or the ones the local Launcher made for this launch
        if self.files is not None:  # the private cluster: its actors run here
            role_keys = self.files.role_keys(keys, role, p.fixed_roles) if keys else None
            args = ActorArgs(dataclasses.replace(plan, keys=role_keys), self.log_dir)
        else:
            args = ActorArgs(plan, self.log_dir, key_files=role_key_files(keys, role, p.fixed_roles) if keys else None)
        return msgspec.json.encode(args)

    def remove(self, pool: ModelPool, rep: Replica, client) -> None:
        """Start removing rep: a registered worker is drained first (its coordinator places nothing more there; `drain`
        stops it once nothing is in flight), one that never registered is stopped at once."""
        if rep.registered is None:
            print(f"pdserve launch: ray: removing {rep.role} worker {rep.worker_id}: not registered "
                  f"{pool.scaler.register_timeout_s:g} s after it was asked for (its actor's log says why)", file=sys.stderr, flush=True)
            pool.replicas.remove(rep)
            stop_actors([rep])
            return
        print(f"pdserve launch: ray: draining {rep.role} worker {rep.worker_id} to remove it: the role's other workers have had "
              f"room for all it has in flight for {self.cfg.downscale_delay_s:g} s", file=sys.stderr, flush=True)
        rep.draining_since = time.monotonic()
        client.drain_worker(rep.worker_id)

    def drain(self, pool: ModelPool, stats: dict, client) -> None:
        """The pool's draining replicas: each stopped once its coordinator shows nothing in flight on it (Autoscaler.drained),
        else told again (a restarted coordinator learns the drain again)."""
        for rep in [r for r in pool.replicas if r.draining_since is not None]:
            why = pool.scaler.drained(stats, rep, time.monotonic())
            if why is None:
                client.drain_worker(rep.worker_id)
                continue
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
            self.scale(pool, stats, client)
            self.report_restarts(pool, client)

    def report_restarts(self, pool: ModelPool, client) -> None:
        """The pool's actors' restart counts to its coordinator, each as the NodeReport its own launcher would send (named
        by the actor, as `ray3`): asked every REPORT_S, reported when answered (a tick never waits for an actor)."""
        now, names = time.monotonic(), {r.name for r in pool.replicas}
        pool.asked = {name: ref for name, ref in pool.asked.items() if name in names}
        for r in pool.replicas:
            ref = pool.asked.get(r.name)
            if ref is None:
                if now >= pool.next_ask:
                    pool.asked[r.name] = r.actor.restarts.remote()
                continue
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del pool.asked[r.name]
            try:
                got = msgspec.json.decode(ray.get(ref))
                client.report_node(r.name, got["restarts"], got["last_exit"])
            except ray.exceptions.RayError:
                pass  # the actor restarts: the next ask
        if now >= pool.next_ask:
            pool.next_ask = now + REPORT_S

    def scale(self, pool: ModelPool, stats: dict, client) -> None:
        """One model's autoscaler on its coordinator's stats: registrations logged, workers added, drained and removed."""
        was = {r.name for r in pool.replicas if r.registered is None}
        add, remove = pool.scaler.decide(stats, pool.replicas, time.monotonic())
        for r in pool.replicas:
            if r.name in was and r.registered is not None:
                print(f"pdserve launch: ray: {r.role} worker {r.worker_id} registered {r.registered - r.asked:.1f} s after it was "
                      f"asked for", file=sys.stderr, flush=True)
        for role, why in add:
            self.add(pool, role, why)
        self.drain(pool, stats, client)  # (those whose drain began at an earlier tick: the stats show it)
        for rep in remove:
            self.remove(pool, rep, client)

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
        ray.shutdown()  # a private cluster stops with it
        if self.files is not None:
            self.files.remove()

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


def start_private_cluster(token_path: str, log_to_driver: bool) -> None:
    """A one-node Ray cluster of this launch: every Ray process binds loopback (with LOOPBACK_NODE_ENV "0", which its processes
    inherit and this one's ray_constants reads at import, Ray takes 127.0.0.1 as the node's address; `_node_ip_address`
    alone is replaced by the routable one), Ray's token authentication on with the token at token_path (RAY_AUTH_MODE and
    RAY_AUTH_TOKEN_PATH, inherited too; RAY_AUTH_TOKEN would take its place), and no dashboard. RuntimeError if Ray did
    otherwise."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    from pdserve.wire.security import is_loopback

    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path, LOOPBACK_NODE_ENV: "0"})
    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")  # this process reads the mode again,
    AuthenticationTokenLoader.instance().reset_cache()  # and the token (the attempt to join may have read another)
    ray.init(namespace=NAMESPACE, log_to_driver=log_to_driver, include_dashboard=False, object_store_memory=PRIVATE_OBJECT_STORE)
    node = ray.util.get_node_ip_address()
    if not is_loopback(f"tcp://{node}:0") or not token_auth_on():
        ray.shutdown()
        raise RuntimeError(f"the private Ray cluster started on {node} with token authentication {token_auth_on()}: "
                           "Ray 2.60's loopback node and token settings did not apply")


SECRET_FLAGS = ("--api-key",)  # launch flags whose value Ray must not record


def without_secret_values(argv: list[str]) -> list[str]:
    """argv with the value of every SECRET_FLAGS flag (`--flag VALUE` or `--flag=VALUE`) replaced by `***`."""
    out = []
    for i, a in enumerate(argv):
        name = a.split("=", 1)[0]
        if name in SECRET_FLAGS and "=" in a:
            a = f"{name}=***"
        elif i and argv[i - 1] in SECRET_FLAGS:
            a = "***"
        out.append(a)
    return out


def hide_secret_flags_from_ray() -> None:
    """Ray records its driver's command line as the job's entrypoint, in its control store (`ray list jobs`, the
    dashboard): record this launch's without the values of SECRET_FLAGS (ray._private.utils.get_entrypoint_name,
    which ray.init calls, is Ray 2.60's)."""
    import subprocess

    import ray._private.utils as ray_utils

    ray_utils.get_entrypoint_name = lambda: subprocess.list2cmdline(without_secret_values([sys.executable, *sys.argv]))


def token_auth_on() -> bool:
    """Whether this process talks to Ray with token authentication (RAY_AUTH_MODE=token)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


def with_cold_start(args: list[str]) -> list[str]:
    """The coordinator's arguments with --cold-start-s DEFAULT_COLD_START_S unless one above 0 is given."""
    if "--cold-start-s" in args:
        i = args.index("--cold-start-s")
        if float(args[i + 1]) > 0:
            return args
        args = args[:i] + args[i + 2:]
    return [*args, "--cold-start-s", f"{DEFAULT_COLD_START_S:g}"]


def tp_size(plan: NodePlan, role: str) -> int:
    """The tensor-parallel size `role`'s workers run with (the last --tensor-parallel-size of the
    engine's and the role's flags; 1 without one)."""
    args = plan.engine_args + (plan.prefill_args if role == "prefill" else plan.decode_args)
    sizes = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--tensor-parallel-size", "-tp")]
    return int(sizes[-1]) if sizes and sizes[-1].isdigit() and int(sizes[-1]) > 0 else 1  # a bad value: the worker's own flag check


def check_supported(plan: NodePlan) -> None:
    """NotSupportedError for what --ray does not run yet."""
    if not plan.coordinator:
        raise NotSupportedError("--ray with a cluster TOML (--config/--node) is not supported: --ray places every worker itself")
