"""Roles follow the load: which worker should change role, and the drain that changes it.
Plain classes over plain data, no sockets and no clock (time is passed in).

Lifecycle: the coordinator `join`s each registered worker (id, node, role) and `leave`s it when
it is dropped. It tallies each served request's TTFT and TPOT against its targets and each shed
by its reason (`Tally`), and every `PlannerConfig.window_s` closes the tally into a `Window`
(per phase: met, missed, load; per worker: queued prompt tokens and streams) and calls `observe`.
Phases are PREFILL and DECODE; a COLOCATED worker counts as a decode worker (`phase_of`).
`observe` returns a `RoleChange` at most once per switch: a phase SHORT (attainment under
`short_attainment`, or load at `short_load`) for `sustain` windows in a row while the other
phase has SLACK (attainment at `slack_attainment`, and its load with one worker fewer under
`donor_load`) moves one worker of the other phase to it. The worker then goes through its
`WorkerRole` stages, which the coordinator drives: ACTIVE -> DRAINING (it is given no new work;
`progress` is told its requests in flight) -> SWITCHED when none are left (the coordinator
announces the role to the worker) -> ACTIVE in the new role when the worker confirms (`confirm`).
A drain past `max_drain_s` is called off (the worker stays in its old role). Each change and
each action held back is counted (`counts`) and the last changes are kept with their reasons.

Hysteresis, as Dynamo's planner and DistServe's re-planning do it: one change at a time and none
while one is under way; a phase must stay short `sustain` windows (one burst does not move a
role); short and slack thresholds lie apart, so the move just made does not undo itself; a worker
keeps a role at least `min_dwell_s`. Only a worker that can take the role without a restart
(`join`'s roles: its Hello.roles) is moved. Never: the last decode worker (nothing could be served), or
the last prefill worker while prompts wait for it or while its phase missed or shed any request in
the last `sustain` windows (under overload the decode workers shed for TPOT while the prefill worker
still takes the prompts their own queues cannot: given away, every prompt then queued behind the
streams and the overload test's p99 TTFT passed its target: docs/performance.md). Placement of the change: the worker comes from
the node where the short phase has the most work per worker of that phase (queued prompt tokens
per prefill worker, streams per decode worker), and among those the one with least in flight.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.common.flags import flag
from pdserve.coordinator.placement import ShedReason, WorkerSnapshot
from pdserve.coordinator.slo import SloTargets
from pdserve.wire.protocol import Role


@dataclass(frozen=True)
class PlannerConfig:
    window_s: float = flag(2.0, group="paths and roles", name="planner_window_s", min=0.1, launch=True,  # the coordinator's period for observe
                           help="the planner's measurement window (a phase must be short 3 windows in a row before a role moves)")
    sustain: int = 3  # windows in a row a phase must be short before a worker moves to it
    min_outcomes: int = 5  # fewer requests in a window: its attainment says nothing
    short_attainment: float = 0.95  # under this share of requests within target: short
    slack_attainment: float = 0.99  # at or over this (or no requests): may give a worker
    short_load: float = 1.0  # load (see Window) at or over this: short
    donor_load: float = 0.7  # the giving phase's load with one worker fewer must stay under this
    min_dwell_s: float = flag(20.0, group="paths and roles", name="planner_dwell_s", min=0.0, launch=True,  # 10 windows
                              help="a worker keeps a role at least this long (no flapping)")
    max_drain_s: float = 30.0  # a drain not done by then is called off


class Stage(enum.IntEnum):
    ACTIVE = 0  # serves work of its role
    DRAINING = 1  # given no new work; its work in flight of the old role runs out
    SWITCHED = 2  # none left: it holds the new role, announced, not yet confirmed; still given no work


@dataclass
class WorkerRole:
    """One worker's role and the drain state machine the coordinator drives."""

    worker_id: str
    node: str
    role: Role
    since: float  # when it took this role
    stage: Stage = Stage.ACTIVE
    target: Role | None = None  # DRAINING: the role it will take
    drain_started: float = 0.0
    roles: frozenset | None = None  # the roles it can switch to (Hello.roles); None: any

    def can_take(self, phase: Role) -> bool:
        """Whether it can be switched into `phase` without a restart."""
        return self.roles is None or phase in self.roles

    def takes(self, role: Role) -> bool:
        """Whether the coordinator may give it new work of this role."""
        return self.stage is Stage.ACTIVE and phase_of(self.role) == phase_of(role)

    def drain(self, target: Role, now: float) -> None:
        if self.stage is not Stage.ACTIVE or target == self.role:
            raise ValueError(f"{self.worker_id}: cannot drain to {target.name} from {self.stage.name} {self.role.name}")
        self.stage, self.target, self.drain_started = Stage.DRAINING, target, now

    def drained(self, inflight: int) -> bool:
        """DRAINING with nothing in flight -> SWITCHED to its target; True when it switched now."""
        if self.stage is not Stage.DRAINING or inflight > 0:
            return False
        self.stage, self.role, self.target = Stage.SWITCHED, self.target, None
        return True

    def confirm(self, role: Role, now: float) -> bool:
        """The worker says it now serves `role`: SWITCHED -> ACTIVE if that is the one announced."""
        if self.stage is not Stage.SWITCHED or role != self.role:
            return False
        self.stage, self.since = Stage.ACTIVE, now
        return True

    def cancel(self) -> None:
        """DRAINING -> ACTIVE in its old role (the drain took too long, or the load turned)."""
        if self.stage is Stage.DRAINING:
            self.stage, self.target = Stage.ACTIVE, None


@dataclass(frozen=True)
class PhaseWindow:
    met: int = 0  # requests within this phase's target
    missed: int = 0  # served over it, or shed for this phase's reason
    # prefill: mean predicted wait of the prompt backlog / TTFT target; decode: mean predicted step / TPOT target
    load: float = 0.0

    def attainment(self, min_outcomes: int) -> float | None:
        n = self.met + self.missed
        return self.met / n if n >= min_outcomes else None


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    queued_tokens: int = 0  # prompt tokens waiting on it (a prefill worker's queue, or local prefills)
    running: int = 0  # requests placed on it (decode: streams)


@dataclass(frozen=True)
class Window:
    now: float
    prefill: PhaseWindow
    decode: PhaseWindow
    loads: tuple[WorkerLoad, ...] = ()


@dataclass(frozen=True)
class RoleChange:
    worker_id: str
    node: str
    old: Role
    new: Role
    at: float
    reason: str


PHASE_OF_SHED = {ShedReason.TTFT: Role.PREFILL, ShedReason.TPOT: Role.DECODE, ShedReason.NO_KV_ROOM: Role.DECODE}


class Tally:
    """One window's outcomes per phase, filled as requests end or are shed."""

    def __init__(self):
        self.met = collections.Counter()
        self.missed = collections.Counter()

    def served(self, ttft: float, tpot: float | None, targets: SloTargets) -> None:
        self._add(Role.PREFILL, ttft <= targets.ttft_s)
        if tpot is not None:
            self._add(Role.DECODE, tpot <= targets.tpot_s)

    def shed(self, reason: ShedReason) -> None:
        self._add(PHASE_OF_SHED[reason], False)

    def _add(self, phase: Role, ok: bool) -> None:
        (self.met if ok else self.missed)[phase] += 1

    def close(self, now: float, prefill_load: float, decode_load: float, loads=()) -> Window:
        """The window's measurements; the tally starts again empty."""
        w = Window(now, PhaseWindow(self.met[Role.PREFILL], self.missed[Role.PREFILL], prefill_load),
                   PhaseWindow(self.met[Role.DECODE], self.missed[Role.DECODE], decode_load), tuple(loads))
        self.met.clear()
        self.missed.clear()
        return w


def phase_loads(prefills: list[WorkerSnapshot], decodes: list[WorkerSnapshot], targets: SloTargets) -> tuple[float, float]:
    """(prefill, decode) load from placement's snapshots: the mean predicted wait of the prompt
    backlog (the prefill workers', or the decode workers' own without any) over the TTFT target,
    and the mean predicted decode step over the TPOT target."""
    backlog = [w.queued_tokens / w.model.tokens_per_second() for w in (prefills or decodes)]
    steps = [w.model.predict(w.requests, w.requests, w.context_tokens) for w in decodes if w.requests]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return mean(backlog) / targets.ttft_s, mean(steps) / targets.tpot_s


OTHER = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}


def phase_of(role: Role) -> Role:
    """A colocated worker is a decode worker that prefills its own prompts, which every decode
    worker does for the prompts sent to it on the LOCAL path (coordinator/paths.py)."""
    return Role.DECODE if role == Role.COLOCATED else role


class Planner:
    def __init__(self, cfg: PlannerConfig = PlannerConfig()):
        self.cfg = cfg
        self.workers: dict[str, WorkerRole] = {}
        self.streak = collections.Counter()  # phase -> windows in a row it was short and the other not
        self.counts = collections.Counter()
        self.changes: collections.deque[RoleChange] = collections.deque(maxlen=32)
        self.recent: collections.deque[Window] = collections.deque(maxlen=cfg.sustain)  # the last windows observed

    # ------------------------------------------------------------------ roster and drains

    def join(self, worker_id: str, node: str, role: Role, now: float, roles=None) -> WorkerRole:
        """roles: those it can switch to without a restart (None: any); it only moves into one of them."""
        self.workers[worker_id] = WorkerRole(worker_id, node, role, now, roles=None if roles is None else frozenset(roles))
        return self.workers[worker_id]

    def leave(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def takes(self, worker_id: str, role: Role) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.takes(role)

    def progress(self, inflight: Mapping[str, int], now: float) -> list[WorkerRole]:
        """Advance the drains: those with nothing left in flight switch (returned: announce their
        role to them); one past max_drain_s is called off."""
        switched = []
        for w in self.workers.values():
            if w.stage is not Stage.DRAINING:
                continue
            if w.drained(inflight.get(w.worker_id, 0)):
                self.counts["switched"] += 1
                switched.append(w)
            elif now - w.drain_started > self.cfg.max_drain_s:
                w.cancel()
                self.counts["drains_called_off"] += 1
        return switched

    def confirm(self, worker_id: str, role: Role, now: float) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.confirm(role, now)

    # ------------------------------------------------------------------ decisions

    def short(self, p: PhaseWindow) -> bool:
        att = p.attainment(self.cfg.min_outcomes)
        return (att is not None and att < self.cfg.short_attainment) or p.load >= self.cfg.short_load

    def observe(self, window: Window) -> RoleChange | None:
        """One window's measurements in; a role change to start (already DRAINING) or None."""
        self.recent.append(window)
        if any(w.stage is not Stage.ACTIVE for w in self.workers.values()):
            self.counts["held:changing"] += 1  # one change at a time; its effect is not measured yet
            return None
        phases = {Role.PREFILL: window.prefill, Role.DECODE: window.decode}
        short = {r: self.short(p) for r, p in phases.items()}
        for phase in phases:
            self.streak[phase] = self.streak[phase] + 1 if short[phase] and not short[OTHER[phase]] else 0
        for phase in phases:
            if self.streak[phase] >= self.cfg.sustain:
                change = self.move_to(phase, window)
                if change is not None:
                    return change
        return None

    def move_to(self, phase: Role, window: Window) -> RoleChange | None:
        """Start moving a worker of the other phase to `phase`, if the other phase can give one."""
        other = OTHER[phase]
        given = [w for w in self.workers.values() if phase_of(w.role) == other]
        loads = {x.worker_id: x for x in window.loads}
        why_not = self.cannot_give(other, given, window, loads)
        if why_not is not None:
            self.counts[f"held:{why_not}"] += 1
            return None
        movable = [w for w in given if w.can_take(phase)]
        if not movable:
            self.counts["held:fixed_roles"] += 1
            return None
        ready = [w for w in movable if window.now - w.since >= self.cfg.min_dwell_s]
        if not ready:
            self.counts["held:dwell"] += 1
            return None
        pressure = self.node_pressure(phase, loads)
        w = min(ready, key=lambda w: (-pressure.get(w.node, 0.0), inflight(loads.get(w.worker_id)), w.worker_id))
        w.drain(phase, window.now)
        self.streak.clear()
        mine, theirs = (window.prefill, window.decode) if phase is Role.PREFILL else (window.decode, window.prefill)
        att = lambda p: "n/a" if p.attainment(self.cfg.min_outcomes) is None else f"{p.attainment(self.cfg.min_outcomes):.2f}"  # noqa: E731
        reason = (f"{phase.name.lower()} short {self.cfg.sustain} windows (attainment {att(mine)}, load {mine.load:.2f}); "
                  f"{other.name.lower()} slack (attainment {att(theirs)}, load {theirs.load:.2f}); "
                  f"node {w.node}: {pressure.get(w.node, 0.0):.0f} {'queued tokens' if phase is Role.PREFILL else 'streams'} per {phase.name.lower()} worker")
        change = RoleChange(w.worker_id, w.node, other, phase, window.now, reason)
        self.counts[f"{other.name.lower()}_to_{phase.name.lower()}"] += 1
        self.changes.append(change)
        return change

    def cannot_give(self, other: Role, given: list[WorkerRole], window: Window, loads: dict) -> str | None:
        """Why the phase `other` cannot give a worker now (None: it can)."""
        p = window.prefill if other is Role.PREFILL else window.decode
        att = p.attainment(self.cfg.min_outcomes)
        if att is not None and att < self.cfg.slack_attainment:
            return "no_slack"
        if len(given) > 1:
            return None if p.load * len(given) / (len(given) - 1) < self.cfg.donor_load else "no_slack"
        if other is Role.DECODE or not given:
            return "last_worker"  # the last decode worker: nothing could be served without one
        # the last prefill worker may go (its prompts then run on the decode workers) once it has none
        # waiting and its phase met every target lately (one that sheds needs it)
        if any(w.prefill.missed for w in self.recent):
            return "last_worker_missed"
        return None if inflight(loads.get(given[0].worker_id)) == 0 and p.load < self.cfg.donor_load else "last_worker"

    def node_pressure(self, phase: Role, loads: dict) -> dict[str, float]:
        """Per node, the work of `phase` on it per worker of `phase` there (+1: the one added)."""
        work, count = collections.Counter(), collections.Counter()
        for w in self.workers.values():
            x = loads.get(w.worker_id)
            if x is not None:
                work[w.node] += x.queued_tokens if phase is Role.PREFILL else x.running * (phase_of(w.role) == Role.DECODE)
            count[w.node] += phase_of(w.role) == phase
        return {node: work[node] / (count[node] + 1) for node in count}

    def summary(self) -> dict:
        """For the stats: each worker's role and stage, the counters, the last changes."""
        return {
            "workers": {w.worker_id: {"node": w.node, "role": w.role.name.lower(), "stage": w.stage.name.lower(),
                                      **({"target": w.target.name.lower()} if w.target is not None else {})}
                        for w in self.workers.values()},
            "counts": dict(self.counts),
            "last_window": {name: dataclasses.asdict(getattr(self.recent[-1], name)) for name in ("prefill", "decode")} if self.recent else {},
            "streak": {r.name.lower(): n for r, n in self.streak.items()},
            "changes": [{"worker": c.worker_id, "node": c.node, "from": c.old.name.lower(), "to": c.new.name.lower(),
                         "at": c.at, "reason": c.reason} for c in self.changes],
        }


def inflight(load: WorkerLoad | None) -> int:
    return 0 if load is None else load.queued_tokens + load.running
