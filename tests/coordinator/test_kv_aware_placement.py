"""KV-aware placement over plain data: a worker expected to hold the request's prefix wins
unless its load outweighs the hit; predictions count only the uncached tokens; the
coordinator's per-worker view of cached block keys is bounded and follows heartbeats."""
import pytest

from pdserve.coordinator import state
from pdserve.coordinator.placement import Outcome, RequestView, WorkerSnapshot, place_colocated, place_pair, predict_prefill
from pdserve.coordinator.slo import SloTargets, StepModel
from pdserve.wire.protocol import Hello, Role

M = StepModel([(1, 100, 100, 0.1), (1, 10, 100, 0.01), (4, 4, 400, 0.01), (8, 8, 800, 0.01), (1, 50, 50, 0.05)])
REQ = RequestView(num_tokens=100, max_tokens=16)


def prefill(wid, queued=0, cached=0):
    return WorkerSnapshot(wid, M, queued_tokens=queued, cached_tokens=cached)


def decode(wid, free=64, requests=0, context=0, cached=0):
    return WorkerSnapshot(wid, M, free_blocks=free, block_size=16, requests=requests, context_tokens=context, cached_tokens=cached)


def test_prefill_with_the_prefix_wins_unless_its_backlog_outweighs_the_hit():
    d = place_pair(REQ, [prefill("cold"), prefill("warm", cached=80)], [decode("d0")], None)
    assert d.prefill == "warm"
    d = place_pair(REQ, [prefill("cold"), prefill("warm", queued=60, cached=80)], [decode("d0")], None)
    assert d.prefill == "warm"  # 60 queued + 20 uncached < 100
    d = place_pair(REQ, [prefill("cold"), prefill("warm", queued=200, cached=80)], [decode("d0")], None)
    assert d.prefill == "cold"


def test_decode_weighs_blocks_to_receive_against_blocks_held():
    d = place_pair(REQ, [prefill("p")], [decode("roomy", free=200), decode("warm", free=20, cached=96)], None)
    assert d.worker == "warm"  # 1 block to receive instead of 7
    d = place_pair(REQ, [prefill("p")], [decode("idle", free=200), decode("warm", free=20, requests=4, context=4 * 400, cached=96)], None)
    assert d.worker == "idle"  # its streams hold 100 blocks: a shared prompt does not pull every stream to one worker
    assert place_pair(REQ, [prefill("p")], [decode("a", free=10), decode("b", free=30)], None).worker == "b"  # no hit: most room


def test_decode_room_counts_only_the_blocks_it_lacks():
    assert place_pair(REQ, [prefill("p")], [decode("d0", free=3)], None).outcome is Outcome.WAIT  # 100 tokens: 7 blocks
    d = place_pair(REQ, [prefill("p")], [decode("d0", free=3, cached=80)], None)
    assert (d.outcome, d.worker) == (Outcome.PLACED, "d0")  # 5 blocks of the prompt shared by its streams: 2 to allocate


def test_ttft_prediction_counts_only_uncached_tokens():
    cold, warm = prefill("cold"), prefill("warm", cached=90)
    assert predict_prefill(warm, 100) < predict_prefill(cold, 100)
    assert predict_prefill(warm, 100) == pytest.approx(M.predict(1, 10, 100))
    d = place_pair(REQ, [cold, warm], [decode("d0")], SloTargets(10.0, 1.0))
    assert d.outcome is Outcome.PLACED and d.prefill == "warm"


def test_colocated_without_slo_prefers_the_prefix_holder():
    assert place_colocated(REQ, [WorkerSnapshot("a", M, free_blocks=100), WorkerSnapshot("b", M, free_blocks=50, cached_tokens=64)], None).worker == "b"
    assert place_colocated(REQ, [WorkerSnapshot("a", M, free_blocks=100), WorkerSnapshot("b", M, free_blocks=50)], None).worker == "a"


def worker(block_size=16, prefix_cache=1):
    h = Hello(3, "w", Role.PREFILL, 1, "h", "b", "m", 1024, 64, block_size, engine={"prefix_cache": prefix_cache})
    return state.WorkerState(h, b"w", 0.0)


def test_view_follows_heartbeats_and_is_bounded(monkeypatch):
    w = worker()
    w.note_prefix([1, 2, 3])
    assert w.cached_tokens([1, 2, 3, 4]) == 48 and w.cached_tokens([9, 1]) == 0
    w.note_prefix([4], [2])
    assert w.cached_tokens([1, 2, 3, 4]) == 16  # a chain stops at its first missing key
    monkeypatch.setattr(state, "MAX_VIEW", 3)
    w.note_prefix([5, 6])
    assert list(w.prefix_view) == [4, 5, 6]
    assert worker(prefix_cache=0).prefix_cache is False and w.prefix_cache is True
