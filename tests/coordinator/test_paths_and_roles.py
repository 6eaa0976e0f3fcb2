"""The coordinator's wiring of issue 23's logic, in one process with its socket sends recorded
(the decisions are what is checked; tests/serving/test_paths.py runs it with real workers):

- each request takes a path: LOCAL (Generate to the decode worker, its blocks reserved there
  until its first token) or REMOTE (Admit on a pair), counted in the stats by path and reason;
- the planner drains a worker that can switch (placement gives it no new work), tells it its
  new role once drained (SetRole), and its RoleSet moves its role; one that cannot switch, or
  refuses, keeps its role;
- finished requests feed the calibration (stats) and /metrics renders paths, role changes and
  the prediction error.
"""
import shutil
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.coordinator.placement import placed
from pdserve.coordinator.planner import PlannerConfig, Stage
from pdserve.coordinator.server import CoordinatorConfig
from pdserve.coordinator.state import Phase
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.wire.protocol import (
    PROTOCOL_VERSION,
    Admit,
    Generate,
    Granted,
    Heartbeat,
    Hello,
    Prefill,
    PrefillDone,
    Role,
    RoleSet,
    SetRole,
    TokenBatch,
    TokenOut,
)
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason, GenerateRequest
from tests.coordinator.recorded import Recorded
from tests.gateway.helpers import exposition_problems, promtool_check
from tests.helpers import free_port

BOTH = [Role.PREFILL, Role.DECODE]




def coordinator(workers, core_share: str = "", **cfg) -> Recorded:
    """workers: (id, role, roles it can take); every one with 64 blocks of 16 tokens; core_share:
    the cores they share (as one launch's workers say in Hello.engine; "": none)."""
    cfg = {"paths": "auto", **cfg}
    c = Recorded(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", **cfg))
    for wid, role, roles in workers:
        c.on_worker(wid.encode(), Hello(PROTOCOL_VERSION, wid, int(role), 1, "h", "b", "m", 2048, 64, 16,
                                        kv_endpoint="tcp://127.0.0.1:1", roles=roles, engine={"core_share": core_share}))
    return c


def start(c: Recorded, rid: str, n: int, max_tokens: int = 4) -> str:
    first = 100 + 1000 * len(c.requests)  # no prompt shares a prefix with another
    prompt = list(range(first, first + n))
    c.start_request(b"client", GenerateRequest(rid, SamplingParams(max_tokens=max_tokens), token_ids=prompt), prompt)
    return c.by_client[(b"client", rid)]


def finish(c: Recorded, wid: str, iid: str, tokens: int = 2) -> None:
    for i in range(tokens):
        c.on_worker(wid.encode(), TokenBatch([TokenOut(iid, 7, finish_reason=FinishReason.LENGTH if i == tokens - 1 else None)]))


def test_without_slo_short_prompts_go_local_and_long_ones_remote(closing):
    c = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])], slo=False, local_prefill_tokens=32)
    closing(c)
    short = start(c, "short", 20)
    assert [(wid, m.request_id) for wid, m in c.taken(Generate)] == [("d", short)] and not c.taken(Admit)
    d = c.workers["d"]
    assert d.reserved_blocks == 2 and d.free_blocks == 62  # a LOCAL prompt's blocks are reserved until its first token
    c.on_worker(b"d", Heartbeat("d", 64, 1, 0, 20))
    assert d.free_blocks == 62  # the heartbeat does not show them taken yet: still reserved
    long_ = start(c, "long", 40)
    assert [(wid, m.request_id) for wid, m in c.taken(Admit)] == [("d", long_)]
    c.on_worker(b"d", TokenBatch([TokenOut(short, 7)]))
    assert c.requests[short].reserved == 0 and c.workers["d"].reserved_blocks == 3  # only the Admit's 3 blocks left
    counts = c.stats()["requests"]
    assert (counts["path:local"], counts["path:remote"]) == (1, 1)
    assert (counts["path_reason:short_prompt"], counts["path_reason:long_prompt"]) == (1, 1)
    assert c.requests[short].path["path"] == "local" and c.requests[long_].path["path"] == "remote"


def test_paths_remote_and_local_pin_the_way(closing):
    remote = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])], slo=False, paths="remote")
    local = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])], slo=False, paths="local", local_prefill_tokens=0)
    closing(remote)
    closing(local)
    start(remote, "a", 5)
    start(local, "b", 600)
    assert len(remote.taken(Admit)) == 1 and not remote.taken(Generate)
    assert len(local.taken(Generate)) == 1 and not local.taken(Admit)
    with pytest.raises(ValueError):
        CoordinatorConfig(paths="sideways")


def test_with_slo_a_request_is_placed_with_both_predictions_and_feeds_the_calibration(closing):
    c = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])])
    closing(c)
    iid = start(c, "r", 20)
    st = c.requests[iid]
    assert st.predicted_ttft is not None and st.predicted_tpot is not None
    assert {"remote_ttft_ms", "remote_tpot_ms", "local_ttft_ms", "local_tpot_ms"} <= set(st.path)
    assert st.path["path_reason"] == "headroom"
    finish(c, st.decode, iid)
    cal = c.stats()["calibration"]
    assert cal["ttft"]["error"]["count"] == 1 and cal["tpot"]["error"]["count"] == 1
    assert cal["ttft"]["headroom"] == c.cfg.ttft_headroom  # the static headroom until enough samples
    assert cal["paths"][st.path["path"]]["ttft"]["error"]["count"] == 1  # and its path's own record


def test_a_streams_tpot_error_is_judged_against_the_highest_tpot_its_batch_was_admitted_at(closing):
    """Two streams on one decode worker: the second is admitted "with one more", so the first's
    TPOT is bounded by that prediction, not its own smaller one (a batch grown by later admissions
    is not the latency model's error); the second's bound is its own prediction."""
    c = coordinator([("d", Role.DECODE, [])], paths="local")
    closing(c)
    w = c.workers["d"]
    w.model.add([(s, s + t, ctx, 0.01 * s + 0.0005 * t) for s in (1, 2, 4, 8) for t in (0, 128) for ctx in (100, 1000)])
    first, second = start(c, "a", 20, max_tokens=8), start(c, "b", 20, max_tokens=8)
    a, b = c.requests[first], c.requests[second]
    assert b.predicted_tpot > a.predicted_tpot  # one more stream in the batch: a longer step
    assert a.tpot_bound == b.predicted_tpot and b.tpot_bound == b.predicted_tpot
    finish(c, "d", first, tokens=3)
    observed = (a.token_times[-1] - a.token_times[0]) / (len(a.token_times) - 1)
    least = c.calibration.cfg.floor * c.request_targets(a).tpot_s
    assert c.calibration.tpot.errors[-1] == pytest.approx((observed - b.predicted_tpot) / max(b.predicted_tpot, least))


def test_workers_of_one_launch_share_cores_and_a_prompt_that_can_stay_local_does(closing):
    """A prompt of 500 tokens beside a busy decode worker: apart (no core share named in the
    Hellos) the idle prefill worker's headroom wins; sharing a launch's cores, the decode worker
    prefills it (its step models are the recorded profile's: a prefill costs the same either way)."""
    profile = [(s, s + t, c, 0.005 + 0.001 * s + 0.0005 * (s + t) + 0.002 * c / 1000)
               for s in (1, 4, 16) for t in (0, 128, 512) for c in (100, 1000, 4000)]
    for share, path, reason in (("", "remote", "headroom"), ("/dev/shm/pdserve-cores-x", "local", "shared_node")):
        c = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])], core_share=share)
        closing(c)
        for w in c.workers.values():
            w.model.add(profile)
        for i in range(4):  # streams on the decode worker (by either path)
            start(c, f"s{i}", 40, max_tokens=200)
        c.on_worker(b"d", Heartbeat("d", 52, 4, 0, 0))
        for i in list(c.requests):
            c.on_worker(b"d", TokenBatch([TokenOut(i, 7)]))  # their prompts are done
        iid = start(c, "long", 500)
        assert (c.requests[iid].path["path"], c.requests[iid].path["path_reason"]) == (path, reason), c.requests[iid].path
        assert set(c.core_groups()) == ({"p", "d"} if share else set())


def test_a_hand_off_is_measured_from_its_kv_send_to_its_first_token(closing):
    c = coordinator([("p", Role.PREFILL, []), ("d", Role.DECODE, [])], paths="remote")
    closing(c)
    iid = start(c, "r", 20)
    st = c.requests[iid]
    c.on_worker(b"d", Granted(iid, [0, 1], st.admissions, 1))
    assert c.taken(Prefill)
    c.on_worker(b"d", TokenBatch([TokenOut(iid, 7)]))  # the first token may come before PrefillDone
    c.on_worker(b"p", PrefillDone(iid, 20, 1000, 0.25, 0.1, 1))
    h = c.stats()["handoff"]["d"]
    # 0.25 s of KV send before its PrefillDone, less the first step predicted at placement
    assert h["count"] == 1 and h["mean_extra_ms"] == pytest.approx(1000 * (0.25 - st.predicted_tpot), abs=30)
    assert c.handoff_times.extra_s("d") == pytest.approx(h["mean_extra_ms"] / 1000, abs=1e-5)


def planning(workers, **cfg) -> Recorded:
    """A coordinator whose planner moves a role after one short window, at once."""
    return coordinator(workers, planner=PlannerConfig(window_s=1.0, sustain=1, min_outcomes=1, min_dwell_s=0.0, max_drain_s=5.0), **cfg)


def prefill_short(c: Recorded, now: float) -> None:
    """One window in which every request missed its TTFT target and met its TPOT target."""
    c.tally.served(100.0, 0.01, c.cfg.targets(0))
    c.next_window = 0.0
    c.plan_roles(now)


def test_a_drained_worker_is_told_its_new_role_and_placement_follows(closing):
    c = planning([("p", Role.PREFILL, BOTH), ("d0", Role.DECODE, BOTH), ("d1", Role.DECODE, BOTH)])
    closing(c)
    busy = {}  # decode worker -> a request on it (LOCAL): each has work in flight
    for wid in ("d0", "d1"):
        st = c.requests[start(c, f"busy-{wid}", 20)]
        if st.decode != wid:  # (both may be placed on one: put this one on wid)
            c.unplace(st)
            c.move(st, Phase.NEW)  # placed again by hand, as a retry would
            c.generate_on(st, c.workers[wid], placed(wid), time.monotonic())
        busy[wid] = st.iid
    now = time.monotonic()
    prefill_short(c, now)
    [change] = c.stats()["planner"]["changes"]
    moving = change["worker"]
    assert (change["from"], change["to"]) == ("decode", "prefill") and "prefill short" in change["reason"]
    assert c.planner.workers[moving].stage is Stage.DRAINING
    assert moving not in [w.hello.worker_id for w in c.alive(Role.DECODE)]  # no new work while it drains
    for i in range(3):
        assert c.requests[start(c, f"n{i}", 20)].decode != moving
    for iid in [i for i in c.workers[moving].requests if i != busy[moving]]:
        finish(c, moving, iid)
    c.plan_roles(now + 0.1)
    assert not c.taken(SetRole)  # a request still runs on it
    finish(c, moving, busy[moving])
    c.plan_roles(now + 0.2)
    [(wid, set_role)] = c.taken(SetRole)
    assert (wid, set_role.role) == (moving, Role.PREFILL)
    c.plan_roles(now + 0.3)
    assert len(c.taken(SetRole)) == 1  # sent again only after SET_ROLE_RESEND_S
    c.plan_roles(now + 1.5)
    assert len(c.taken(SetRole)) == 2 and c.taken(SetRole)[1][1] == set_role
    c.on_worker(moving.encode(), RoleSet(moving, Role.PREFILL, set_role.change))
    assert c.workers[moving].role is Role.PREFILL and c.planner.workers[moving].stage is Stage.ACTIVE
    assert moving in [w.hello.worker_id for w in c.alive(Role.PREFILL)]
    stats = c.stats()
    assert {w["id"]: w["role"] for w in stats["workers"]}[moving] == "prefill"
    assert stats["planner"]["counts"]["decode_to_prefill"] == 1 and stats["planner"]["counts"]["confirmed"] == 1
    assert stats["planner"]["active"] and stats["planner"]["workers"][moving]["role"] == "prefill"


def test_a_worker_that_refuses_or_cannot_switch_keeps_its_role(closing):
    c = planning([("p", Role.PREFILL, BOTH), ("d0", Role.DECODE, BOTH), ("d1", Role.DECODE, [])])
    closing(c)
    now = time.monotonic()
    prefill_short(c, now)
    [change] = c.stats()["planner"]["changes"]
    assert change["worker"] == "d0"  # d1's Hello.roles is empty: only its own
    c.plan_roles(now + 0.1)
    [(_, set_role)] = c.taken(SetRole)
    c.on_worker(b"d0", RoleSet("d0", Role.DECODE, set_role.change, error="not supported: test"))
    assert c.workers["d0"].role is Role.DECODE and c.planner.takes("d0", Role.DECODE)
    assert c.planner.counts["refused"] == 1
    prefill_short(c, now + 2)  # never asked again: neither decode worker can move now
    assert c.planner.counts["held:fixed_roles"] >= 1 and len(c.taken(SetRole)) == 1


def test_without_slo_or_with_no_planner_roles_stay(closing):
    for cfg in (dict(slo=False), dict(planner=None)):
        c = coordinator([("p", Role.PREFILL, BOTH), ("d", Role.DECODE, BOTH)], **cfg)
        closing(c)
        assert c.planner is None and c.stats()["planner"] == {"enabled": False, "active": False}


def test_metrics_render_paths_role_changes_and_prediction_error(closing):
    c = planning([("p", Role.PREFILL, BOTH), ("d0", Role.DECODE, BOTH), ("d1", Role.DECODE, BOTH)])
    closing(c)
    iid = start(c, "r", 20)
    finish(c, c.requests[iid].decode, iid)
    prefill_short(c, time.monotonic())
    text = GatewayMetrics("m").render(c.stats()).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("pdserve_request_path_total", (("model_name", "m"), ("path", "local")))] == 1
    assert samples[("pdserve_role_changes_total", (("from", "decode"), ("model_name", "m"), ("to", "prefill")))] == 1
    assert ("pdserve_prediction_error_p99", (("model_name", "m"), ("phase", "ttft"))) in samples
    assert samples[("pdserve_admission_headroom", (("model_name", "m"), ("phase", "tpot")))] == c.cfg.tpot_headroom
    assert ("pdserve_path_prediction_error_p50", (("model_name", "m"), ("path", "local"), ("phase", "ttft"))) in samples
    assert exposition_problems(text) == []  # every family a coordinator's stats fill keeps promtool's rules
    if shutil.which("promtool"):
        assert promtool_check(text)[0] == 0, promtool_check(text)[1]
