"""The planner over plain data: windows of measurements in, role changes out; the drain stages.

A load shift that should move a role (sustained TTFT misses with decode slack; decode misses with
an idle prefill worker), and ones that should not (one short spike; both phases short; the last
decode worker; a worker still in its dwell time; a change under way), the node a worker is taken
from, and the drain state machine ACTIVE -> DRAINING -> SWITCHED -> ACTIVE.
"""
import pytest

from pdserve.coordinator.placement import ShedReason, WorkerSnapshot
from pdserve.coordinator.planner import (
    PhaseWindow,
    Planner,
    PlannerConfig,
    Stage,
    Tally,
    Window,
    WorkerLoad,
    WorkerRole,
    phase_loads,
)
from pdserve.coordinator.slo import SloTargets, StepModel
from pdserve.wire.protocol import Role

CFG = PlannerConfig(window_s=1.0, sustain=3, min_dwell_s=10.0, max_drain_s=5.0)
OK = PhaseWindow(met=50, missed=0, load=0.2)  # every request in time, a fifth of the budget used
PREFILL_SHORT = PhaseWindow(met=30, missed=20, load=1.5)
DECODE_SHORT = PhaseWindow(met=30, missed=20, load=1.2)


def planner(*workers, now=0.0):
    """workers: (id, node, role)"""
    p = Planner(CFG)
    for wid, node, role in workers:
        p.join(wid, node, role, now)
    return p


def feed(p, windows, start=100.0, loads=()):
    """Observe one window a second from `start`; the changes started."""
    return [c for i, (pw, dw) in enumerate(windows) if (c := p.observe(Window(start + i, pw, dw, tuple(loads)))) is not None]


P1_D2 = (("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE), ("d1", "a", Role.DECODE))


def test_sustained_ttft_misses_with_decode_slack_turn_a_decode_worker_into_a_prefill_worker():
    p = planner(*P1_D2)
    loads = (WorkerLoad("d0", running=6), WorkerLoad("d1", running=2), WorkerLoad("p0", queued_tokens=5000))
    changes = feed(p, [(PREFILL_SHORT, OK)] * 3, loads=loads)
    assert len(changes) == 1
    c = changes[0]
    assert (c.worker_id, c.old, c.new) == ("d1", Role.DECODE, Role.PREFILL)  # the one with least in flight
    assert "prefill short 3 windows (attainment 0.60, load 1.50)" in c.reason and "decode slack" in c.reason
    assert p.workers["d1"].stage is Stage.DRAINING and not p.takes("d1", Role.DECODE) and not p.takes("d1", Role.PREFILL)
    assert p.counts["decode_to_prefill"] == 1 and p.summary()["changes"][0]["to"] == "prefill"


def test_decode_misses_with_an_idle_prefill_worker_turn_the_last_prefill_worker_into_a_decode_worker():
    p = planner(("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE))
    changes = feed(p, [(OK, DECODE_SHORT)] * 3, loads=(WorkerLoad("p0"), WorkerLoad("d0", running=40)))
    assert [(c.worker_id, c.new) for c in changes] == [("p0", Role.DECODE)]


def test_the_last_prefill_worker_stays_while_prompts_wait_for_it():
    p = planner(("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE))
    assert feed(p, [(OK, DECODE_SHORT)] * 4, loads=(WorkerLoad("p0", queued_tokens=300), WorkerLoad("d0", running=40))) == []
    assert p.counts["held:last_worker"] == 2  # windows 3 and 4


def test_the_last_decode_worker_never_moves():
    p = planner(("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE))
    assert feed(p, [(PREFILL_SHORT, OK)] * 5) == []
    assert p.counts["held:last_worker"] == 3


def test_a_single_short_spike_moves_nothing():
    p = planner(*P1_D2)
    assert feed(p, [(OK, OK), (PREFILL_SHORT, OK), (PREFILL_SHORT, OK), (OK, OK), (PREFILL_SHORT, OK), (OK, OK)]) == []
    assert p.streak[Role.PREFILL] == 0


def test_few_requests_say_nothing_and_both_phases_short_move_nothing():
    p = planner(*P1_D2)
    two_misses = PhaseWindow(met=1, missed=2, load=0.2)  # under min_outcomes: attainment unknown
    assert feed(p, [(two_misses, OK)] * 4) == []
    assert feed(p, [(PREFILL_SHORT, DECODE_SHORT)] * 4) == []  # capacity short overall: moving cannot help


def test_a_donor_phase_without_slack_keeps_its_worker():
    p = planner(*P1_D2)
    busy = PhaseWindow(met=50, missed=0, load=0.5)  # 0.5 on two workers -> 1.0 on one
    assert feed(p, [(PREFILL_SHORT, busy)] * 4) == []
    assert p.counts["held:no_slack"] == 2


def test_dwell_time_prevents_flapping():
    p = planner(*P1_D2)
    [c] = feed(p, [(PREFILL_SHORT, OK)] * 3)
    assert p.progress({c.worker_id: 0}, 103.0) == [p.workers[c.worker_id]]
    assert p.confirm(c.worker_id, Role.PREFILL, 103.5)
    # the load turns at once: decode now short, prefill idle; c's worker must keep its new role 10 s
    flips = feed(p, [(OK, DECODE_SHORT)] * 5, start=104.0)
    assert [x.worker_id for x in flips] == ["p0"]  # the worker that was prefill all along may go
    p2 = planner(*P1_D2)
    [c2] = feed(p2, [(PREFILL_SHORT, OK)] * 3)
    p2.progress({c2.worker_id: 0}, 103.0)
    p2.confirm(c2.worker_id, Role.PREFILL, 103.5)
    p2.join("p0", "a", Role.PREFILL, 103.5)  # (re-registered: its dwell starts again too)
    assert feed(p2, [(OK, DECODE_SHORT)] * 5, start=104.0) == []
    assert p2.counts["held:dwell"] == 3
    assert [x.worker_id for x in feed(p2, [(OK, DECODE_SHORT)] * 3, start=114.0)] in (["p0"], [c2.worker_id])  # dwell over


def test_only_a_worker_that_can_take_the_role_moves():
    p = Planner(CFG)
    p.join("p0", "a", Role.PREFILL, 0.0, roles=[Role.PREFILL])
    p.join("d0", "a", Role.DECODE, 0.0, roles=[])  # Hello.roles empty: only its own
    p.join("d1", "a", Role.DECODE, 0.0, roles=[Role.DECODE])
    assert feed(p, [(PREFILL_SHORT, OK)] * 4) == []
    assert p.counts["held:fixed_roles"] == 2
    p.join("d1", "a", Role.DECODE, 0.0, roles=[Role.DECODE, Role.PREFILL])  # (re-registered able to switch)
    [c] = feed(p, [(PREFILL_SHORT, OK)] * 3, start=110.0)
    assert (c.worker_id, c.new) == ("d1", Role.PREFILL)


def test_nothing_moves_while_a_change_is_under_way():
    p = planner(*P1_D2, ("d2", "a", Role.DECODE))
    [c] = feed(p, [(PREFILL_SHORT, OK)] * 3)
    assert feed(p, [(PREFILL_SHORT, OK)] * 4, start=103.0) == []
    assert p.counts["held:changing"] == 4


def test_the_worker_comes_from_the_node_where_the_short_phase_has_most_work_per_worker():
    p = planner(("pa", "a", Role.PREFILL), ("da", "a", Role.DECODE), ("pb", "b", Role.PREFILL), ("db1", "b", Role.DECODE),
                ("db2", "b", Role.DECODE))
    loads = (WorkerLoad("pa", queued_tokens=6000), WorkerLoad("pb", queued_tokens=100), WorkerLoad("da", running=5),
             WorkerLoad("db1", running=1), WorkerLoad("db2", running=1))
    [c] = feed(p, [(PREFILL_SHORT, OK)] * 3, loads=loads)
    assert (c.worker_id, c.node) == ("da", "a")  # node a: 3000 queued tokens per prefill worker, node b: 50
    assert "node a: 3000 queued tokens per prefill worker" in c.reason


# ------------------------------------------------------------------ the drain state machine

def test_drain_switch_confirm():
    w = WorkerRole("w", "a", Role.DECODE, since=0.0)
    assert w.takes(Role.DECODE) and w.takes(Role.COLOCATED) and not w.takes(Role.PREFILL)
    w.drain(Role.PREFILL, 1.0)
    assert w.stage is Stage.DRAINING and not w.takes(Role.DECODE) and not w.takes(Role.PREFILL)
    assert not w.drained(inflight=2) and w.role is Role.DECODE  # its streams still run
    assert w.drained(inflight=0) and (w.stage, w.role) == (Stage.SWITCHED, Role.PREFILL)
    assert not w.takes(Role.PREFILL)  # until the worker confirms
    assert not w.confirm(Role.DECODE, 2.0) and w.stage is Stage.SWITCHED  # not the role announced
    assert w.confirm(Role.PREFILL, 2.0) and w.takes(Role.PREFILL) and w.since == 2.0
    with pytest.raises(ValueError):
        w.drain(Role.PREFILL, 3.0)  # already that role


def test_a_drain_past_its_limit_is_called_off():
    p = planner(*P1_D2)
    [c] = feed(p, [(PREFILL_SHORT, OK)] * 3)
    assert p.progress({c.worker_id: 3}, 104.0) == []
    assert p.workers[c.worker_id].stage is Stage.DRAINING
    assert p.progress({c.worker_id: 3}, 108.0) == []  # 6 s > max_drain_s
    assert p.workers[c.worker_id].takes(Role.DECODE) and p.counts["drains_called_off"] == 1


def test_a_worker_that_leaves_is_forgotten():
    p = planner(*P1_D2)
    p.leave("d0")
    assert set(p.workers) == {"p0", "d1"} and not p.takes("d0", Role.DECODE)


# ------------------------------------------------------------------ measurements

def test_tally_counts_outcomes_and_sheds_per_phase():
    t = Tally()
    targets = SloTargets(1.0, 0.1)
    t.served(0.5, 0.05, targets)
    t.served(1.5, 0.2, targets)
    t.served(0.5, None, targets)  # one token: no TPOT
    t.shed(ShedReason.TTFT)
    t.shed(ShedReason.NO_KV_ROOM)
    w = t.close(9.0, 0.3, 0.4)
    assert (w.prefill.met, w.prefill.missed, w.decode.met, w.decode.missed) == (2, 2, 1, 2)
    assert (w.prefill.load, w.decode.load, w.now) == (0.3, 0.4, 9.0)
    assert t.close(10.0, 0, 0).prefill == PhaseWindow()


def test_phase_loads_from_snapshots():
    m = StepModel([(1, 100, 100, 0.1), (8, 8, 800, 0.04), (1, 1, 100, 0.01), (4, 4, 400, 0.025)])
    rate = m.tokens_per_second()
    prefill_load, decode_load = phase_loads([WorkerSnapshot("p", m, queued_tokens=200)],
                                            [WorkerSnapshot("d", m, requests=8, context_tokens=800), WorkerSnapshot("i", m)],
                                            SloTargets(2.0, 0.1))
    assert prefill_load == pytest.approx(200 / rate / 2.0)
    assert decode_load == pytest.approx(m.predict(8, 8, 800) / 0.1)  # the idle worker has no step


def test_the_last_prefill_worker_stays_while_its_phase_sheds():
    """Overload: the decode phase sheds for TPOT window after window while the idle-looking prefill
    worker still loses a request or two to its TTFT target (too few to count as attainment): it
    stays. Once the prefill phase has met every target for `sustain` windows it may go."""
    p = planner(("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE))
    loads = (WorkerLoad("p0"), WorkerLoad("d0", running=40))
    one_shed = PhaseWindow(met=2, missed=1, load=0.1)  # under min_outcomes: attainment unknown
    assert feed(p, [(one_shed, DECODE_SHORT), (OK, DECODE_SHORT), (OK, DECODE_SHORT)], loads=loads) == []
    assert p.counts["held:last_worker_missed"] == 1  # window 3: the shed of window 1 is in the last 3
    [c] = feed(p, [(OK, DECODE_SHORT)], start=103.0, loads=loads)  # window 4: three clean prefill windows
    assert (c.worker_id, c.new) == ("p0", Role.DECODE)
    p2 = planner(("p0", "a", Role.PREFILL), ("d0", "a", Role.DECODE))
    assert feed(p2, [(one_shed, DECODE_SHORT), (OK, DECODE_SHORT)] * 4, loads=loads) == []  # a shed every other window


def test_a_load_that_swings_between_phases_moves_nothing():
    """Short prompt bursts between decode-heavy spells: neither phase stays short `sustain` windows."""
    p = planner(*P1_D2)
    assert feed(p, [(PREFILL_SHORT, OK), (PREFILL_SHORT, OK), (OK, DECODE_SHORT), (OK, DECODE_SHORT)] * 3) == []
    assert sum(n for k, n in p.counts.items() if "_to_" in k) == 0
