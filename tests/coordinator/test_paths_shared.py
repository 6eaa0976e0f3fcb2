"""What sharing one node's cores costs each path, over plain data (coordinator/paths.py share_node,
coordinator/placement.py deferral, coordinator/calibration.py HandoffTimes and per-path headroom).

A decode worker whose node has a busy prefill worker defers its steps to it (runtime/cores.py), so
a LOCAL prompt's first token waits for turns; a prefill worker yields turns to its node's decode
streams, so a REMOTE prompt's prefill stretches; a hand-off costs what was measured. On a shared
node LOCAL wins whenever it meets the targets (the launch serves as one colocated worker with every
core), REMOTE takes what LOCAL cannot; across nodes the headroom decides.
"""
import dataclasses

import pytest

from pdserve.coordinator.calibration import Calibration, CalibrationConfig, HandoffTimes
from pdserve.coordinator.paths import Path, choose_path, share_node
from pdserve.coordinator.placement import Outcome, SharedCores, ShedReason, deferral, local_steps, predict_prefill, predict_remote_prefill
from pdserve.coordinator.slo import SloTargets
from tests.coordinator.test_paths import TARGETS, M, decode, prefill, req

CAP = 0.2  # stall cap of a 500 ms TPOT target: a turn asked for after 0.1 s


def shared(prefills, decodes, nodes):
    return share_node(prefills, decodes, nodes, CAP)


def test_a_decode_worker_sees_its_own_nodes_busy_prefill_workers_only():
    p, d = shared([prefill("p0", queued=2000)], [decode("d0"), decode("d1")], {"p0": "a", "d0": "a", "d1": "b"})
    busy = 2000 / M.tokens_per_second()
    assert d[0].shared.work_s == pytest.approx(busy)
    assert d[0].shared.turn_s == pytest.approx(CAP)  # a prefill step of 2000 tokens is longer than the cap: the cap
    assert d[1].shared is None  # another node: its cores are its own
    idle_p, idle_d = shared([prefill("p0")], [decode("d0")], {"p0": "a", "d0": "a"})
    assert idle_d[0].shared == SharedCores(0.0, pytest.approx(0.1), 0.0, CAP)  # nothing to defer to: no wait


def test_a_prefill_worker_yields_its_nodes_decode_streams_their_turns():
    p, _ = shared([prefill("p0")], [decode("d0", requests=4, context=400)], {"p0": "a", "d0": "a"})
    step = M.predict(4, 4, 400)
    assert p[0].shared == SharedCores(pytest.approx(step), 0.1)  # a turn of one decode step each 0.1 s
    # a short prompt's prefill (its step under 0.1 s) loses a decode step every 0.1 s ...
    assert predict_remote_prefill(p[0], 32) == pytest.approx(predict_prefill(prefill(), 32) * (1 + step / 0.1))
    # ... a long one's a decode step after each of its steps
    assert predict_remote_prefill(p[0], 1500) == pytest.approx(predict_prefill(prefill(), 1500) * (1 + step / M.predict(1, 1500, 1500)))
    alone, _ = shared([prefill("p0")], [decode("d0", requests=0, context=0)], {"p0": "a", "d0": "a"})
    assert predict_remote_prefill(alone[0], 32) == predict_prefill(prefill(), 32)


def test_a_local_prompt_waits_a_turn_a_step_while_the_prefill_worker_has_work():
    w = dataclasses.replace(decode(queued=3000), shared=SharedCores(work_s=5.0, turn_s=0.2))
    assert local_steps(w, 128) == 2  # 3128 tokens in chunks of 2048
    assert deferral(w, 2) == pytest.approx(0.4)
    assert deferral(dataclasses.replace(w, shared=SharedCores(0.3, 0.2)), 2) == pytest.approx(0.3)  # never past its work
    assert deferral(decode(), 5) == 0.0  # no node mates
    nodes = {"p0": "a", "d0": "a"}
    alone = choose_path(req(128), [prefill()], [decode()], TARGETS)
    p, d = shared([prefill("p0", queued=1000)], [decode("d0")], nodes)
    busy = choose_path(req(128), p, d, TARGETS)
    assert busy.local.predicted_ttft == pytest.approx(alone.local.predicted_ttft + d[0].shared.turn_s)


def test_on_a_shared_node_local_wins_whenever_it_meets_the_targets():
    # a long prompt beside busy streams: across nodes the idle prefill worker has more headroom ...
    apart = choose_path(req(1500), [prefill()], [decode(requests=4, context=1000)], TARGETS)
    assert (apart.path, apart.reason) == (Path.REMOTE, "headroom")
    # ... on one node it takes the same cores as a local prefill would, and the hand-off on top
    p, d = shared([prefill("p0")], [decode("d0", requests=4, context=1000)], {"p0": "a", "d0": "a"})
    c = choose_path(req(1500), p, d, TARGETS)
    assert (c.path, c.reason, c.decision.prefill) == (Path.LOCAL, "shared_node", None)
    short = choose_path(req(64), p, d, TARGETS)
    assert (short.path, short.reason) == (Path.LOCAL, "headroom")


def test_on_a_shared_node_the_prefill_worker_takes_what_local_cannot():
    # streams of 16 tokens would carry the local 1500-token step past their TPOT (local_stall_ok);
    # the prefill worker yields them a turn each of its steps, which they can bear
    d = dataclasses.replace(decode("d0", requests=4, context=1000), shortest_output=16)
    p, ds = shared([prefill("p0")], [d], {"p0": "a", "d0": "a"})
    c = choose_path(req(1500), p, ds, TARGETS)
    assert (c.path, c.reason, c.decision.prefill) == (Path.REMOTE, "only_remote", "p0")
    assert c.local.predicted_ttft is None and c.remote.predicted_ttft < TARGETS.ttft_s
    # the decode worker's own prompt backlog is on the same cores: it holds up both ways
    p, ds = shared([prefill("p0")], [decode("d0", requests=4, context=1000, queued=2500)], {"p0": "a", "d0": "a"})
    assert choose_path(req(128), p, ds, TARGETS).path is None


def test_a_measured_hand_off_cost_is_in_the_remote_prediction():
    d = decode(requests=4, context=1000)
    base = choose_path(req(1500), [prefill()], [d], TARGETS)
    slow = choose_path(req(1500), [prefill()], [dataclasses.replace(d, handoff_s=0.3)], TARGETS)
    assert slow.remote.predicted_ttft == pytest.approx(base.remote.predicted_ttft + 0.3)
    # a hand-off measured cheaper than the predicted first step (the first token leaves with the KV)
    fast = choose_path(req(1500), [prefill()], [dataclasses.replace(d, handoff_s=-1.0)], TARGETS)
    assert fast.remote.predicted_ttft == pytest.approx(base.remote.predicted_ttft - base.remote.predicted_tpot)
    # measured costly enough, the pair misses the TTFT target and the prompt stays local
    late = choose_path(req(1500), [prefill()], [dataclasses.replace(d, handoff_s=1.5)], TARGETS)
    assert (late.path, late.reason) == (Path.LOCAL, "only_local")


def test_hand_off_times_are_the_mean_cost_beyond_the_predicted_step_per_decode_worker():
    h = HandoffTimes(window=4)
    for observed in (0.05, 0.07, 0.09, 0.11, 0.13):  # the first falls out of the window
        h.record("d0", observed, 0.04)
    h.record("d0", float("nan"), 0.04)
    assert h.extra_s("d0") == pytest.approx(0.10 - 0.04)
    assert h.extra_s("d1") == 0.0
    assert h.summary() == {"d0": {"count": 4, "mean_extra_ms": 60.0}}
    h.forget("d0")
    assert h.extra_s("d0") == 0.0


def test_each_path_is_admitted_against_its_own_errors_once_it_has_enough():
    c = Calibration(CalibrationConfig(min_samples=10))
    base = SloTargets(2.0, 0.25)
    for _ in range(20):
        c.record_ttft(1.0, 1.5, path="local")  # local's TTFT 50% late
        c.record_tpot(0.1, 0.1, path="local")
        c.record_ttft(1.0, 1.0, path="remote")  # remote's on time
        c.record_tpot(0.1, 0.1, path="remote")
    for _ in range(5):
        c.record_ttft(1.0, 1.0, path="other")  # too few of its own: the pooled errors
        c.record_tpot(0.1, 0.1, path="other")
    assert c.targets(base, 0.8, 0.9, "local").ttft_s == pytest.approx(2.0 / 1.5)
    assert c.targets(base, 0.8, 0.9, "remote").ttft_s == pytest.approx(1.6)  # on time: the static headroom, never looser
    pooled = c.targets(base, 0.8, 0.9)
    assert c.targets(base, 0.8, 0.9, "other") == pooled and pooled.ttft_s == pytest.approx(2.0 / 1.5)
    s = c.summary(0.8, 0.9)["paths"]
    assert s["local"]["ttft"]["error"]["p50"] == pytest.approx(0.5) and s["remote"]["ttft"]["error"]["p99"] == pytest.approx(0.0)
    assert s["other"]["ttft"]["error"]["count"] == 5 and s["other"]["ttft"]["headroom"] == pytest.approx(1 / 1.5, abs=1e-4)


def test_local_targets_apart_from_remote_ones_decide_the_path():
    # LOCAL's errors call for half the TTFT target: a prompt whose local TTFT is ~1.2 s goes remote
    d = decode(queued=1000)
    assert choose_path(req(128), [prefill()], [d], TARGETS).local.predicted_ttft > 1.0
    c = choose_path(req(128), [prefill()], [d], TARGETS, local_targets=SloTargets(1.0, TARGETS.tpot_s))
    assert (c.path, c.reason) == (Path.REMOTE, "only_remote")


def test_a_decode_worker_with_a_full_batch_takes_no_local_prompt_under_slo_control():
    """Its prompt would wait for a stream to end, on either path: shed."""
    full = dataclasses.replace(decode(requests=8), max_seqs=8)
    c = choose_path(req(64), [prefill()], [full], TARGETS)
    assert (c.path, c.reason, c.local.outcome, c.local.reason) == (None, "neither", Outcome.SHED, ShedReason.TPOT)
    assert c.remote.outcome is Outcome.SHED and "max_num_seqs" in c.remote.detail
    assert choose_path(req(64), [prefill()], [dataclasses.replace(full, max_seqs=9)], TARGETS).path is Path.LOCAL
    assert choose_path(req(64), [prefill()], [full], None).path is Path.LOCAL  # without targets: it queues there


def test_a_pair_on_a_shared_node_predicts_tpot_stretched_by_what_its_prefill_worker_took_lately():
    """The prompts placed on a node's prefill worker in the last ADMIT_WINDOW_S take that share of
    the node's time from the decode worker's steps: its streams' TPOT stretches by 1 / (1 - share),
    by no more than the stall cap a step, on both paths; on another node (or with no recent
    prompts) the plain step."""
    from pdserve.coordinator.placement import ADMIT_WINDOW_S, place_pair, predict_step
    tokens = int(3 * M.tokens_per_second())  # about 3 s of prompts in the 10 s window
    recent = dataclasses.replace(prefill("p0"), recent_prompt_tokens=tokens)
    p, d = shared([recent], [decode("d0")], {"p0": "a", "d0": "a"})
    share = tokens / M.tokens_per_second() / ADMIT_WINDOW_S
    assert d[0].shared.prefill_share == pytest.approx(share) and d[0].shared.stall_s == CAP
    loose = SloTargets(ttft_s=10.0, tpot_s=10.0)
    step = predict_step(d[0], 128)
    assert place_pair(req(128), p, d, loose).predicted_tpot == pytest.approx(step + min(step / (1 - share) - step, CAP))
    busier = dataclasses.replace(d[0], shared=dataclasses.replace(d[0].shared, prefill_share=0.9))
    assert place_pair(req(128), p, [busier], loose).predicted_tpot == pytest.approx(step + CAP)  # a step waits no more than the cap
    apart_p, apart_d = shared([recent], [decode("d0")], {"p0": "a", "d0": "b"})
    assert place_pair(req(128), apart_p, apart_d, loose).predicted_tpot == pytest.approx(predict_step(decode("d0"), 128))
    local = choose_path(req(128), p, d, loose).local
    alone = choose_path(req(128), apart_p, apart_d, loose).local
    assert local.predicted_tpot > alone.predicted_tpot  # LOCAL's streams wait for the node's prefills too


def test_a_pair_predicts_tpot_stretched_by_the_local_prompts_its_decode_worker_took_lately():
    """With --paths auto a decode worker also prefills LOCAL prompts in its steps: a REMOTE
    admission into it sees its streams stretched by them as LOCAL does, so where LOCAL refuses a
    prompt for TPOT, REMOTE does too (it took what LOCAL refused, and its prefill stretched every stream)."""
    from pdserve.coordinator.placement import place_pair, predict_step, prefill_share
    busy = dataclasses.replace(decode("d0", requests=8, context=2000), recent_prompt_tokens=int(5 * M.tokens_per_second()))
    step = predict_step(busy, 128)
    loose = SloTargets(ttft_s=10.0, tpot_s=10.0)
    share = prefill_share(busy, 128)
    assert 0.3 < share < 0.9
    assert place_pair(req(128), [prefill()], [busy], loose).predicted_tpot == pytest.approx(step / (1 - share))
    idle = dataclasses.replace(busy, recent_prompt_tokens=0)
    assert place_pair(req(128), [prefill()], [idle], loose).predicted_tpot == pytest.approx(step)
    tight = SloTargets(ttft_s=10.0, tpot_s=(step + step / (1 - share)) / 2)  # the plain step meets it, the stretched one not
    c = choose_path(req(128), [prefill()], [busy], tight)
    assert c.path is None and c.remote.reason is ShedReason.TPOT and c.local.outcome is Outcome.SHED


def test_a_pair_takes_no_decode_worker_with_a_full_batch_under_slo_control():
    """The hand-off would wait there for a stream to end, unpredicted: shed (or, parked, wait)."""
    from pdserve.coordinator.placement import WAIT, place_pair
    full = dataclasses.replace(decode(requests=8), max_seqs=8)
    d = place_pair(req(64), [prefill()], [full], TARGETS)
    assert (d.outcome, d.reason) == (Outcome.SHED, ShedReason.TPOT) and "max_num_seqs (8)" in d.detail
    assert place_pair(dataclasses.replace(req(64), parked=True), [prefill()], [full], TARGETS) is WAIT
    assert place_pair(req(64), [prefill()], [dataclasses.replace(full, max_seqs=9)], TARGETS).outcome is Outcome.PLACED
    assert place_pair(req(64), [prefill()], [full], None).outcome is Outcome.PLACED  # without targets: it queues there
