"""Placement over plain data: worker snapshots, a request and targets in, a Decision out.

No sockets, no clock: every branch of `place_pair` (placed, wait, shed for TTFT, TPOT and no KV
room, a parked request) and of `place_colocated` (placed, shed for TTFT and TPOT, a parked
request; a colocated worker queues prompts itself, so it never answers WAIT).
"""
import dataclasses

import pytest

from pdserve.coordinator.placement import (
    RELAY_OVERHEAD_S,
    Outcome,
    RequestView,
    ShedReason,
    WorkerSnapshot,
    computed_blocks,
    handoff_need,
    place_colocated,
    place_pair,
    prefill_share,
)
from pdserve.coordinator.slo import SloTargets, StepModel


def model(step_s: float) -> StepModel:
    """A worker whose every measured step took step_s, whatever its size."""
    return StepModel([(1, 100, 100, step_s), (4, 4, 400, step_s), (1, 1, 100, step_s), (8, 8, 800, step_s)])


FAST, SLOW = model(0.01), model(3.0)
TARGETS = SloTargets(ttft_s=1.0, tpot_s=0.1)
REQ = RequestView(num_tokens=100, max_tokens=32, waited_s=0.05)


def prefill(wid, m=FAST, queued=0, requests=0):
    return WorkerSnapshot(wid, m, queued_tokens=queued, requests=requests)


def decode(wid, m=FAST, free=64, requests=0, context=0):
    return WorkerSnapshot(wid, m, free_blocks=free, block_size=16, requests=requests, context_tokens=context)


# ------------------------------------------------------------------ pairs, SLO control off

def test_pair_without_slo_takes_the_least_loaded_prefill_and_the_decode_with_most_room():
    d = place_pair(REQ, [prefill("p0", queued=500), prefill("p1", queued=10)], [decode("d0", free=10), decode("d1", free=40)], None)
    assert (d.outcome, d.prefill, d.worker, d.predicted_ttft) == (Outcome.PLACED, "p1", "d1", None)


def test_pair_without_slo_waits_for_kv_room():
    d = place_pair(REQ, [prefill("p0")], [decode("d0", free=6)], None)  # 100 tokens need 7 blocks of 16
    assert d.outcome is Outcome.WAIT and d.worker is None


def test_a_sliding_window_decode_worker_needs_room_for_the_window_only():
    """Its grant leaves the blocks before the window out (runtime.kv_cache): 100 tokens, window
    32, blocks of 16 need blocks 4..6, 3 of them; with the SLO's check for room too."""
    windowed = WorkerSnapshot("d0", FAST, free_blocks=3, block_size=16, kv_window=32)
    assert place_pair(REQ, [prefill("p0")], [windowed], None).worker == "d0"
    assert place_pair(REQ, [prefill("p0")], [windowed], TARGETS).worker == "d0"
    assert place_pair(REQ, [prefill("p0")], [dataclasses.replace(windowed, free_blocks=2)], None).outcome is Outcome.WAIT


def test_a_kv_group_decode_worker_needs_each_sliding_groups_window_and_the_full_groups_all():
    """KV groups (runtime.kv_groups: Gemma's sliding layers beside full ones), windows (0, 32, 32):
    100 tokens in blocks of 16 need the full group's 7 and blocks 4..6 of each sliding group, 13;
    computed on the worker itself, every group's 7 at once (21)."""
    grouped = WorkerSnapshot("d0", FAST, free_blocks=13, block_size=16, kv_group_windows=(0, 32, 32))
    assert handoff_need(100, 0, 16, 0, (0, 32, 32)) == 13 and computed_blocks(100, 16, (0, 32, 32)) == 21
    assert place_pair(REQ, [prefill("p0")], [grouped], None).worker == "d0"
    assert place_pair(REQ, [prefill("p0")], [dataclasses.replace(grouped, free_blocks=12)], None).outcome is Outcome.WAIT


# ------------------------------------------------------------------ pairs, SLO control on

def test_pair_is_placed_where_the_predicted_ttft_is_lowest():
    d = place_pair(REQ, [prefill("busy", queued=2825 * 2), prefill("idle")], [decode("d0", requests=1, context=100)], TARGETS)
    assert (d.outcome, d.prefill, d.worker) == (Outcome.PLACED, "idle", "d0")
    # waited + its prompt's step + relay + one decode step of the decode worker
    assert d.predicted_ttft == pytest.approx(0.05 + 0.01 + RELAY_OVERHEAD_S + 0.01 + RELAY_OVERHEAD_S / 3, rel=1e-3)


def test_pair_is_shed_when_the_predicted_ttft_misses():
    d = place_pair(REQ, [prefill("p0", m=SLOW)], [decode("d0")], TARGETS)
    assert d.outcome is Outcome.SHED and d.reason is ShedReason.TTFT and d.detail.startswith("predicted TTFT 30")


def test_pair_is_shed_when_every_decode_worker_would_miss_tpot():
    d = place_pair(REQ, [prefill("p0")], [decode("d0", m=SLOW, requests=3, context=300)], TARGETS)
    assert d.outcome is Outcome.SHED and d.reason is ShedReason.TPOT and "predicted TPOT 3001 ms" in d.detail


def test_pair_is_shed_when_no_decode_worker_has_kv_room():
    d = place_pair(REQ, [prefill("p0")], [decode("d0", free=6), decode("d1", free=0)], TARGETS)
    assert d.outcome is Outcome.SHED and d.reason is ShedReason.NO_KV_ROOM and d.detail == "decode full: no KV room"


def test_an_idle_decode_worker_takes_a_request_whatever_its_model_says():
    d = place_pair(REQ, [prefill("p0")], [decode("slow-idle", m=SLOW), decode("slow-busy", m=SLOW, requests=1)], SloTargets(10.0, 0.1))
    assert (d.outcome, d.worker) == (Outcome.PLACED, "slow-idle")


def test_a_parked_request_is_never_shed():
    parked = RequestView(100, 32, waited_s=30.0, parked=True)  # far past its TTFT target
    late = place_pair(parked, [prefill("p0")], [decode("d0")], TARGETS)
    assert late.outcome is Outcome.PLACED and late.predicted_ttft > TARGETS.ttft_s
    assert place_pair(parked, [prefill("p0")], [decode("d0", free=0)], TARGETS).outcome is Outcome.WAIT
    assert place_pair(parked, [prefill("p0")], [decode("d0", m=SLOW, requests=2)], TARGETS).outcome is Outcome.WAIT


# ------------------------------------------------------------------ colocated workers

def colocated(wid, m=FAST, free=64, requests=0, context=0, queued=0, recent=0):
    return WorkerSnapshot(wid, m, free, 16, queued, requests, context, recent)


def test_colocated_without_slo_takes_the_worker_with_most_room():
    d = place_colocated(REQ, [colocated("c0", free=5), colocated("c1", free=50), colocated("c2", free=50, requests=3)], None)
    assert (d.outcome, d.worker, d.prefill, d.predicted_ttft) == (Outcome.PLACED, "c1", None, None)


def test_without_slo_a_full_batch_comes_after_a_worker_with_a_place_whatever_their_free_blocks():
    """A worker running its max_num_seqs takes a prompt only when every other does too: its heartbeat's free blocks may
    not count what was just placed there (seen under `pdserve launch --ray`: three long requests on one of two)."""
    full = dataclasses.replace(colocated("c0", free=60, requests=2), max_seqs=2)
    open_ = dataclasses.replace(colocated("c1", free=20, requests=1), max_seqs=2)
    assert place_colocated(REQ, [full, open_], None).worker == "c1"
    assert place_pair(REQ, [prefill("p0")], [full, open_], None).worker == "c1"
    assert place_colocated(REQ, [full, dataclasses.replace(open_, requests=2)], None).worker == "c0"  # all full: most room


def test_colocated_is_placed_on_the_lowest_predicted_ttft():
    d = place_colocated(REQ, [colocated("backlogged", queued=2825), colocated("free")], TARGETS)
    assert (d.outcome, d.worker) == (Outcome.PLACED, "free")
    step = 0.01 + RELAY_OVERHEAD_S / 3
    assert d.predicted_ttft == pytest.approx(0.05 + 0.01 + step + RELAY_OVERHEAD_S, rel=1e-3)


def test_colocated_is_shed_when_the_predicted_ttft_misses():
    d = place_colocated(REQ, [colocated("c0", m=SLOW)], TARGETS)
    assert d.outcome is Outcome.SHED and d.reason is ShedReason.TTFT


def test_colocated_is_shed_when_its_prompts_stretch_the_streams_past_tpot():
    # a step of 10 ms meets a 100 ms TPOT alone; prompts taking ~90% of the worker's time stretch it 10x
    busy = colocated("c0", requests=4, context=400, recent=90_000)
    assert prefill_share(busy, 100) == pytest.approx(90_000 * 0.01 / 100 / 10, rel=1e-3)
    d = place_colocated(REQ, [busy], TARGETS)
    assert d.outcome is Outcome.SHED and d.reason is ShedReason.TPOT and "with one more" in d.detail
    assert place_colocated(REQ, [colocated("c0", requests=4, context=400)], TARGETS).outcome is Outcome.PLACED


def test_a_parked_colocated_request_is_placed_without_predictions():
    d = place_colocated(RequestView(100, 32, waited_s=30.0, parked=True), [colocated("c0", m=SLOW)], TARGETS)
    assert (d.outcome, d.worker, d.predicted_ttft) == (Outcome.PLACED, "c0", None)
