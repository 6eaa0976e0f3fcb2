"""A worker drained before its launcher removes it (DrainWorker: an autoscaler's scale-down), in one
coordinator with its sends recorded: from the drain on, placement skips the worker (new requests go
elsewhere, or wait while it is the only one), its requests in flight complete there, the stats show
the drain (`draining`: what was in flight at its start, what was placed since: 0), and its going once
drained counts `workers_removed` and places nothing again (no duplicate). A worker restarted under
a drained id stays drained; a repeated DrainWorker changes nothing. tests/faults/test_ray_launch.py
runs the same through `pdserve launch --ray`'s scale-down."""
import pytest

from pdserve.wire.protocol import Admit, DrainWorker, Generate, Role, TokenBatch, TokenOut
from pdserve_client.protocol import Final, FinishReason
from tests.coordinator.test_cold_start import coordinator, register, start


@pytest.fixture
def c():
    c = coordinator()
    yield c
    c.release_sockets()


def placed_on(c, iid) -> str:
    [wid] = [wid for wid, m in c.to_workers if isinstance(m, (Generate, Admit)) and m.request_id == iid]
    return wid


def finish(c, wid, iid) -> None:
    for i in range(2):  # max_tokens=2 (tests/coordinator/test_cold_start.py start)
        c.on_worker(wid.encode(), TokenBatch([TokenOut(iid, 7, finish_reason=FinishReason.LENGTH if i else None)]))


def worker_stats(c, wid) -> dict:
    return next(w for w in c.stats()["workers"] if w["id"] == wid)


def test_a_draining_worker_gets_no_new_request_and_its_own_complete(c):
    register(c, "d0", Role.DECODE)
    register(c, "d1", Role.DECODE)
    first = start(c, "r0")
    going = placed_on(c, first)
    other = ({"d0", "d1"} - {going}).pop()
    c.on_worker(b"launcher", DrainWorker(going))
    c.on_worker(b"launcher", DrainWorker(going))  # again (every tick until it is stopped): nothing changes
    assert worker_stats(c, going)["draining"]["inflight_at_start"] == 1 and worker_stats(c, other)["draining"] is None
    later = [start(c, f"r{i}") for i in range(1, 7)]
    assert {placed_on(c, iid) for iid in later} == {other}  # without the drain every one goes to `going` (most room, first)
    finish(c, going, first)
    finals = {m.request_id: m for m in c.to_clients if isinstance(m, Final)}
    assert finals["r0"].finish_reason is FinishReason.LENGTH and finals["r0"].completion_tokens == 2
    w = worker_stats(c, going)
    assert w["inflight"] == 0 and w["draining"]["placed_since"] == 0  # the launcher stops it now
    sent = len(c.to_workers)
    c.drop_worker(going, "worker stopped answering")  # stopped by its launcher: silent, then dropped
    counts = c.stats()["requests"]
    assert counts["drains"] == 1 and counts["workers_removed"] == 1 and "workers_lost" not in counts and "retries" not in counts
    assert not [m for _, m in c.to_workers[sent:] if isinstance(m, (Generate, Admit))]  # nothing placed again
    register(c, going, Role.DECODE)  # its actor restarted under the same id (Ray): still drained
    assert placed_on(c, start(c, "r9")) == other


def test_a_request_waits_while_the_only_worker_drains_and_a_worker_lost_mid_drain_counts_lost(c):
    register(c, "d0", Role.DECODE)
    inflight = start(c, "r0")
    c.on_worker(b"launcher", DrainWorker("d0"))
    waiting = start(c, "r1")
    assert placed_on(c, inflight) == "d0" and waiting in c.requests and waiting in c.pending  # parked, not placed on d0
    c.retry_pending(0.0)  # a retry tick: still nowhere to go
    assert not [m for _, m in c.to_workers if isinstance(m, Generate) and m.request_id == waiting]
    register(c, "d1", Role.DECODE)  # the autoscaler's new worker (the request waits: its role is short)
    c.retry_pending(0.0)
    assert placed_on(c, waiting) == "d1"
    c.drop_worker("d0", "worker stopped answering")  # lost with a request in flight (a crash mid-drain): placed again
    counts = c.stats()["requests"]
    assert counts["workers_lost"] == 1 and "workers_removed" not in counts and counts["retries"] == 1
