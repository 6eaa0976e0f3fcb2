"""The flags of `pdserve launch --ray` (its workers as Ray actors, their counts following the
traffic), declared on one dataclass as every role's flags are (common/flags.py), the per-role
replica limits read from them, and the autoscaler's decisions. Nothing here imports ray:
`pdserve launch --help` and a launch without --ray never load it (pdserve/ray_launch.py does,
once --ray is given), and the decisions are tested without a cluster.

Lifecycle: a RayConfig is built once by `pdserve launch` from its flags; `replica_limits` checks
the --min-replicas / --max-replicas values (N, ROLE=N, MODEL:ROLE=N) against the roles the launch
runs and the models it serves, and gives each model its own limits (a bad value, an unknown model
or role, is a usage error before anything starts). pdserve/ray_launch.py then keeps one `Replica` per worker
actor and hands the coordinator's stats to `Autoscaler.decide` every tick; a replica it removes
drains first (`draining_since`; the coordinator places nothing more there) and `Autoscaler.drained`
says when it may be stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.flags import flag
from pdserve.launch import ROLES
from pdserve_client.errors import InvalidRequestError

GROUP = "Ray cluster"


@dataclass
class RayConfig:
    address: str | None = flag(None, group=GROUP, name="ray",
                               help="run the workers as Ray actors on this Ray cluster (ADDRESS as `ray.init` takes it; auto: the "
                                    "cluster `ray start` runs on this machine, else a private one started here); the coordinator "
                                    "and the gateway run on this node (docs/operations.md, Ray)")
    num_cpus: float = flag(1.0, group=GROUP, name="ray_num_cpus", min=0,
                           help="with --ray: CPUs Ray reserves for each worker (it places workers where these are free)")
    num_gpus: float = flag(0.0, group=GROUP, name="ray_num_gpus", min=0, help="with --ray: GPUs Ray reserves for each worker")
    min_replicas: tuple = flag(factory=tuple, group=GROUP, multiple=True,
                               help="with --ray: the fewest workers of a role (of each model), N (every role), ROLE=N or MODEL:ROLE=N "
                                    "(one model, by its served name; the most specific wins) (0: none while idle, the next "
                                    "request waits for a cold start; default: the launch's count)")
    max_replicas: tuple = flag(factory=tuple, group=GROUP, multiple=True,
                               help="with --ray: the most workers of a role (of each model), N (every role), ROLE=N or "
                                    "MODEL:ROLE=N; above the launch's count, workers are added while the role is short (default: the launch's count)")
    downscale_delay_s: float = flag(600.0, group=GROUP, min=0,
                                    help="with --ray: once the role's other workers have had room (their max_num_seqs) for "
                                         "all it has in flight this long, its least busy worker is drained and removed, "
                                         "while the role has more than --min-replicas (Ray Serve's default)")

    def named_roles(self) -> set[str]:
        """Roles --min-replicas / --max-replicas name (ROLE=N, MODEL:ROLE=N): a role the launch starts none of may still scale."""
        keys = set(_limit_values(self.min_replicas, "--min-replicas")) | set(_limit_values(self.max_replicas, "--max-replicas"))
        return {role for _, role in keys} - {""}

    def replica_limits(self, counts: dict[str, int], models: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
        """model -> role -> (min, max) for the roles this launch runs (`counts`: its --prefill/--decode/--colocated
        counts, which stand where no limit is given) and each of its models (their served names). The most
        specific value wins: MODEL:ROLE=N, then ROLE=N, then N. InvalidRequestError for a bad value, a model the
        launch does not serve or a role it does not run."""
        lo, hi = _limit_values(self.min_replicas, "--min-replicas"), _limit_values(self.max_replicas, "--max-replicas")
        for name, given in (("--min-replicas", lo), ("--max-replicas", hi)):
            for model, role in given:
                if model and model not in models:
                    raise InvalidRequestError(f"{name} {model}:{role}=...: no model is served as {model!r} (this launch serves "
                                              f"{', '.join(models)})")
                if model and role not in counts:
                    raise InvalidRequestError(f"{name} {model}:{role}=...: this launch runs no {role} worker (its roles: "
                                              f"{', '.join(counts)})")
        out = {}
        for model in models:
            out[model] = {}
            for role, n in counts.items():
                mn = _most_specific(lo, model, role, n)
                mx = _most_specific(hi, model, role, max(n, mn))
                if mx < max(mn, 1):
                    raise InvalidRequestError(f"--max-replicas of {model}:{role} is {mx}: it must be >= 1 and >= --min-replicas ({mn})")
                out[model][role] = (mn, mx)
        return out


def _most_specific(given: dict[tuple[str, str], int], model: str, role: str, default: int) -> int:
    for key in ((model, role), ("", role), ("", "")):
        if key in given:
            return given[key]
    return default


def _limit_values(values: tuple, name: str) -> dict[tuple[str, str], int]:
    """`N` (key ("", "")), `ROLE=N` (("", ROLE)) or `MODEL:ROLE=N` ((MODEL, ROLE)) values by (model, role)."""
    out = {}
    for value in values:
        key, _, n = value.rpartition("=")
        model, colon, role = key.rpartition(":")
        if role not in ("", *ROLES) or not n.isdigit() or (colon and not (model and role)):
            raise InvalidRequestError(f"{name} wants N, ROLE=N or MODEL:ROLE=N (ROLE: {', '.join(ROLES)}; MODEL: a served "
                                      f"model's name), got {value!r}")
        out[(model, role)] = int(n)
    return out


@dataclass
class Replica:
    name: str  # its NodePlan name: its worker id is f"{name}-{role}-0"
    role: str
    actor: object
    asked: float  # when it was asked for (monotonic)
    registered: float | None = None  # when its worker first appeared in the coordinator's stats
    draining_since: float | None = None  # when its removal began: drained (DrainWorker), stopped once nothing is in flight

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.role}-0"


@dataclass
class Autoscaler:
    """Decides, from one stats document, which role gets a worker more and which replica goes."""

    limits: dict[str, tuple[int, int]]  # role -> (min, max)
    downscale_delay_s: float
    serving: set[str]  # the roles a request needs (the launch's): each comes back from zero with the first request
    cold_refusals: int = 0  # error:cold_start counted so far
    # a replica whose worker has not registered this long after it was asked for (its actor pending for resources, or
    # its worker unable to start on its node) is given up: removed, so that its role can grow again
    register_timeout_s: float = 300.0
    # a draining worker still holding requests this long after its drain began is stopped all the same (they are placed again)
    drain_timeout_s: float = 600.0
    spare_since: dict[str, float] = field(default_factory=dict)  # role -> since when its others' room holds its load (spare)

    def short(self, stats: dict, role: str, workers: list[dict]) -> str | None:
        """Why `role` needs a worker more (None: it does not)."""
        load = stats.get("loads", {}).get("prefill" if role == "prefill" else "decode", 0.0)
        if load > 1.0:
            return f"its phase load is {load:.2f} (> 1: the predicted wait is over the target)"
        queued = sum(w["queue"] for w in workers)
        if queued:
            return f"{queued} requests are queued on its workers"
        if role != "prefill" and stats.get("pending"):
            return f"{stats['pending']} requests wait for a worker with room"
        refused = stats.get("requests", {}).get("error:cold_start", 0) - self.cold_refusals
        if not workers and role in self.serving and (refused or stats.get("pending")):
            return f"it has no worker and requests wait ({stats.get('pending', 0)}) or were refused ({refused}: cold_start)"
        return None

    def decide(self, stats: dict, replicas: list[Replica], now: float) -> tuple[list[tuple[str, str]], list[Replica]]:
        """([(role, why)] to add, [replica] to remove); marks registrations and each role's spare clock."""
        by_id = {w["id"]: w for w in stats.get("workers", [])}
        add, remove = [], []
        replicas = [r for r in replicas if r.draining_since is None]  # those being removed count no more
        for role, (lo, hi) in self.limits.items():
            stale = [r for r in replicas if r.role == role and r.registered is None and now - r.asked > self.register_timeout_s]
            remove += stale
            mine = [r for r in replicas if r.role == role and r not in stale]
            for r in mine:
                if r.registered is None and r.worker_id in by_id:
                    r.registered = now
            why = self.short(stats, role, [by_id[r.worker_id] for r in mine if r.worker_id in by_id])
            if why:
                self.spare_since.pop(role, None)
                if len(mine) < hi and all(r.registered is not None for r in mine):
                    add.append((role, why))
            elif len(mine) > lo:
                spare = self.spare(role, mine, by_id, now)
                remove += [spare] if spare is not None else []
            else:
                self.spare_since.pop(role, None)
        self.cold_refusals = stats.get("requests", {}).get("error:cold_start", 0)
        return add, remove

    def spare(self, role: str, mine: list[Replica], by_id: dict, now: float) -> Replica | None:
        """The replica `role` can give up now (None: none): the one with the fewest requests in flight (the newest of
        equals), once the others' room (each its max_num_seqs, from its Hello's engine) has held the role's whole
        in-flight load for downscale_delay_s, Ray Serve's rule with each worker's max_num_seqs as its target of
        ongoing requests. A role's last worker is spare once nothing is in flight on it; the spare one may hold
        requests: its drain lets them complete there. Never while a replica of the role has not registered."""
        workers = [by_id.get(r.worker_id) for r in mine]
        if any(w is None for w in workers):
            self.spare_since.pop(role, None)
            return None
        inflight = [w["inflight"] for w in workers]  # (none queued: `short` answers a role with a queue first)
        i = min(range(len(mine)), key=lambda j: (inflight[j], -(mine[j].registered or 0.0)))
        room = sum(max(1, int((w.get("engine") or {}).get("max_num_seqs") or 1)) for j, w in enumerate(workers) if j != i)
        if sum(inflight) > room:
            self.spare_since.pop(role, None)
            return None
        since = self.spare_since.setdefault(role, now)
        return mine[i] if now - since >= self.downscale_delay_s else None

    def drained(self, stats: dict, rep: Replica, now: float) -> str | None:
        """Why a draining replica may be stopped now (None: not yet, its drain goes on): its worker is not registered
        (nothing can be on it), or the coordinator shows it draining with nothing in flight (each request placed on it
        before the drain completed there, and none is placed there since), or its drain outlasted drain_timeout_s."""
        w = next((w for w in stats.get("workers", []) if w["id"] == rep.worker_id), None)
        if w is None:
            return "its worker is not registered"
        d = w.get("draining")
        if d is not None and not w["inflight"]:
            return (f"drained in {now - rep.draining_since:.1f} s: the {d['inflight_at_start']} requests in flight at its start "
                    f"completed, {d['placed_since']} placed on it since")
        if now - rep.draining_since > self.drain_timeout_s:
            return f"still {w['inflight']} requests in flight {self.drain_timeout_s:g} s after its drain began: they are placed again"
        return None
