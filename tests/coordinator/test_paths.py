"""The path per request over plain data: snapshots, a request and targets in, a PathChoice out.

Workloads where each way should win: a short prompt, and a prompt whose prefix the decode worker
holds, go LOCAL; a long prompt with an idle prefill worker and busy decode streams goes REMOTE;
a long prefill queue sends it LOCAL. With and without SLO control; a parked request; no room.
"""
import dataclasses
import itertools

import pytest

from pdserve.coordinator.paths import Path, PathChoice, PathRule, choose_path, headroom
from pdserve.coordinator.placement import Decision, Outcome, RequestView, ShedReason, WorkerSnapshot, placed
from pdserve.coordinator.slo import SloTargets, StepModel


def linear(a=0.01, per_seq=0.002, per_token=0.001, per_kctx=0.005) -> StepModel:
    """A worker whose steps took exactly a + per_seq*seqs + per_token*tokens + per_kctx*context/1000."""
    grid = itertools.product((1, 4, 16), (0, 128, 512), (100, 1000, 4000))
    return StepModel([(s, s + t, c, a + per_seq * s + per_token * (s + t) + per_kctx * c / 1000) for s, t, c in grid])


M = linear()
TARGETS = SloTargets(ttft_s=2.0, tpot_s=0.1)


def prefill(wid="p0", queued=0, cached=0):
    return WorkerSnapshot(wid, M, queued_tokens=queued, cached_tokens=cached)


def decode(wid="d0", requests=4, context=400, free=1000, queued=0, recent=0, cached=0):
    return WorkerSnapshot(wid, M, free, 16, queued, requests, context, recent, cached)


def req(tokens, max_tokens=32, parked=False):
    return RequestView(tokens, max_tokens, waited_s=0.01, parked=parked)


def test_headroom_is_the_tighter_of_ttft_and_tpot():
    assert headroom(placed("d", ttft=0.5, tpot=0.09), TARGETS) == pytest.approx(0.1)
    assert headroom(placed("d", ttft=1.8, tpot=0.01), TARGETS) == pytest.approx(0.1)
    assert headroom(Decision(Outcome.WAIT), TARGETS) is None


# ------------------------------------------------------------------ SLO control on

def test_a_short_prompt_is_prefilled_on_the_decode_worker():
    c = choose_path(req(64), [prefill()], [decode()], TARGETS)
    assert (c.path, c.reason, c.decision.prefill, c.decision.worker) == (Path.LOCAL, "headroom", None, "d0")
    # both ways were predicted and meet the targets; remote's lead is within the margin
    assert c.remote.outcome is Outcome.PLACED and c.local.outcome is Outcome.PLACED
    assert 0 <= headroom(c.remote, TARGETS) - headroom(c.local, TARGETS) <= PathRule().remote_margin
    assert c.attributes()["path"] == "local" and c.attributes()["remote_ttft_ms"] > 0


def test_a_long_prompt_goes_to_an_idle_prefill_worker_when_the_decode_worker_is_busy():
    c = choose_path(req(1500), [prefill()], [decode(requests=4, context=1000)], TARGETS)
    assert (c.path, c.reason, c.decision.prefill, c.decision.worker) == (Path.REMOTE, "headroom", "p0", "d0")
    # local would stretch the streams by the 1.5 s prompt: its TPOT is predicted far higher
    assert c.local.predicted_tpot > 2 * c.remote.predicted_tpot
    busier = choose_path(req(1500), [prefill()], [decode(requests=16, context=4000)], TARGETS)
    assert (busier.path, busier.reason, busier.local.reason) == (Path.REMOTE, "only_remote", ShedReason.TPOT)


def test_a_prefix_cached_on_the_decode_worker_keeps_a_long_prompt_local():
    c = choose_path(req(1500), [prefill()], [decode(requests=16, context=4000, cached=1488)], TARGETS)
    assert c.path is Path.LOCAL
    assert c.local.predicted_ttft < c.remote.predicted_ttft  # 12 tokens to compute against 1500


def test_a_long_prefill_queue_sends_the_prompt_local():
    c = choose_path(req(1500), [prefill(queued=4000)], [decode(requests=4, context=1000)], TARGETS)
    assert (c.path, c.reason) == (Path.LOCAL, "only_local")  # remote: ~6 s to the first token
    assert c.remote.outcome is Outcome.SHED and c.remote.reason is ShedReason.TTFT


def test_without_prefill_workers_every_prompt_is_local():
    c = choose_path(req(1500), [], [decode()], TARGETS)
    assert (c.path, c.reason, c.remote) == (Path.LOCAL, "only_local", None)


def test_a_request_neither_way_can_serve_in_time_is_shed_with_the_pairs_reason():
    c = choose_path(req(1500), [prefill(queued=8000)], [decode(requests=16, context=4000, queued=8000)], TARGETS)
    assert (c.path, c.reason, c.decision.outcome, c.decision.reason) == (None, "neither", Outcome.SHED, ShedReason.TTFT)


def test_no_kv_room_sheds_under_slo_control_and_waits_without():
    full = [decode(free=2)]
    c = choose_path(req(1500), [], full, TARGETS)
    assert (c.decision.outcome, c.decision.reason) == (Outcome.SHED, ShedReason.NO_KV_ROOM)
    assert choose_path(req(1500), [prefill()], full, None).decision.outcome is Outcome.WAIT


def test_a_parked_request_is_never_shed():
    late = RequestView(1500, 32, waited_s=30.0, parked=True)
    c = choose_path(late, [prefill(queued=8000)], [decode(requests=16, context=4000)], TARGETS)
    assert c.decision.outcome is Outcome.PLACED and c.reason == "parked"


# ------------------------------------------------------------------ SLO control off: Dynamo's rule

@pytest.mark.parametrize("tokens, cached, p_queued, d_queued, path, reason", [
    (128, 0, 0, 0, Path.LOCAL, "short_prompt"),
    (1500, 0, 0, 0, Path.REMOTE, "long_prompt"),
    (1500, 1280, 0, 0, Path.LOCAL, "short_prompt"),  # 220 uncached on the decode worker
    (1500, 0, 4000, 0, Path.LOCAL, "long_queue"),  # 4000 tokens ahead > 2 prompts of 1500
    (1500, 0, 4000, 2000, Path.REMOTE, "long_prompt"),  # 2000 ahead of the decode worker's own: not 2 prompts
])
def test_without_targets_the_rule_decides(tokens, cached, p_queued, d_queued, path, reason):
    c = choose_path(req(tokens), [prefill(queued=p_queued)], [decode(queued=d_queued, cached=cached)], None)
    assert (c.path, c.reason) == (path, reason)
    assert c.decision.prefill == ("p0" if path is Path.REMOTE else None) and c.decision.predicted_ttft is None


def test_choice_is_plain_data():
    c = choose_path(req(64), [prefill()], [decode()], None)
    assert isinstance(c, PathChoice) and c.attributes() == {"path": "local", "path_reason": "short_prompt"}


def test_a_local_prefill_that_would_stall_short_streams_past_their_tpot_goes_remote():
    """The step that takes in a 1500-token prompt (~1.5 s) is one gap for every running stream:
    streams of 16 tokens would carry ~100 ms of it per token, past the 100 ms target; streams of
    512 tokens only ~3 ms. With the shortest output unknown (0) nothing is assumed."""
    short = WorkerSnapshot("d0", M, 1000, 16, 0, 4, 1000, 0, 0, shortest_output=16)
    c = choose_path(req(1500), [prefill()], [short], TARGETS)
    assert (c.path, c.local.outcome, c.local.reason) == (Path.REMOTE, Outcome.SHED, ShedReason.TPOT)
    long_ = dataclasses.replace(short, shortest_output=512)
    assert choose_path(req(1500), [prefill(queued=4000)], [long_], TARGETS).path is Path.LOCAL
    assert choose_path(req(64), [prefill()], [short], TARGETS).path is Path.LOCAL  # a short prompt's step is short


def test_a_colocated_launch_admits_by_the_local_rule_which_counts_the_prompts_own_share():
    # `--colocated` places through choose_path with no prefill worker (coordinator/server.py
    # choose_colocated): the worker's streams stretch by this prompt's step too, not only by the
    # prompts it took lately. place_colocated alone, as that launch placed before, admits this one.
    from pdserve.coordinator.placement import place_colocated
    w = decode(requests=4, context=400, recent=5750)
    assert place_colocated(req(512), [w], TARGETS).outcome is Outcome.PLACED
    c = choose_path(req(512), [], [w], TARGETS)
    assert (c.path, c.decision.outcome, c.decision.reason) == (None, Outcome.SHED, ShedReason.TPOT)
    assert "prompts' share 0.64" in c.decision.detail and c.remote is None
    calm = choose_path(req(512), [], [decode(requests=4, context=400, recent=2000)], TARGETS)
    assert (calm.path, calm.decision.worker) == (Path.LOCAL, "d0")


def test_workers_of_one_role_sharing_a_node_see_their_steps_stretched_by_their_busy_mates():
    """Two decode workers on one 2-core share: the idle one, given a prompt while the other is
    busy, steps on 1 thread (its model stretched by the worker's slowdown factor); the busy one,
    given more while its mate idles, keeps both; two busy ones share; a worker alone on its node,
    or without a core count, is not stretched; 4 cores and two busy workers: 2 threads each, a
    third given work: 1."""
    from pdserve.coordinator.paths import share_role_cores

    asked = []

    def factor(wid, alone, threads):
        asked.append((wid, alone, threads))
        return alone / threads * 0.8

    busy, idle, elsewhere = decode("d0", requests=3), decode("d1", requests=0), decode("d2", requests=5)
    node = {"d0": "vm/a", "d1": "vm/a", "d2": "other/a"}
    out = share_role_cores([busy, idle, elsewhere], node, {"d0": 2, "d1": 2, "d2": 2}, factor)
    assert asked == [("d1", 2, 1)]
    assert out[0] is busy and out[2] is elsewhere
    assert out[1].model.predict(4, 4, 400) == pytest.approx(1.6 * M.predict(4, 4, 400))
    both = share_role_cores([busy, decode("d1", requests=2)], node, {"d0": 2, "d1": 2}, factor)
    assert all(s.model.predict(4, 4, 400) == pytest.approx(1.6 * M.predict(4, 4, 400)) for s in both)
    alone = share_role_cores([busy, decode("d1", requests=0)], {"d0": "vm/a", "d1": "vm/a"}, {"d0": 2}, factor)
    assert alone[1].model is M  # d1's Hello named no cores: not shared
    idle_mates = share_role_cores([decode("d0", requests=0), decode("d1", requests=0)], node, {"d0": 2, "d1": 2}, factor)
    assert all(s.model is M for s in idle_mates)  # a worker given work beside idle mates runs on every core
    asked.clear()
    four = share_role_cores([decode("a", requests=1), decode("b", requests=1), decode("c", requests=0)],
                            {"a": "n", "b": "n", "c": "n"}, {"a": 4, "b": 4, "c": 4}, factor)
    assert sorted(asked) == [("a", 4, 2), ("b", 4, 2), ("c", 4, 1)]
    assert four[2].model.predict(1, 1, 100) == pytest.approx(3.2 * M.predict(1, 1, 100))
