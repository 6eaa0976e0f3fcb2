"""A hand-off whose KVReady is lost on the way (dropped by the kv socket, a full inbox, a bad
header) never leaves its grant fenced while the writer lives: once the prefill worker reports
PrefillDone for that grant, a request its decode worker has not started within
handoff_timeout_s fails with kv_transfer_failed and the grant is released without a writer
(Release(prefill_sent=False)), whether the request still lives or ended meanwhile. A request
whose first token came is left alone, and so is a PrefillDone naming another grant. Requests
whose worker messages could outgrow a worker socket are refused before any worker sees them.

The coordinator in one process with its socket sends recorded (the decisions are what is
checked); the decode side of the Release is checked on a real Worker with a live writer.
"""
import time

import pytest

from pdserve.coordinator.server import CoordinatorConfig
from pdserve.wire.protocol import PROTOCOL_VERSION, Abort, Admit, Granted, Hello, Prefill, PrefillDone, Release, Role, TokenBatch, TokenOut
from pdserve_client.params import SamplingParams, StructuredOutput
from pdserve_client.protocol import MAX_CONTROL_MESSAGE, AbortRequest, ErrorReply, GenerateRequest
from tests.coordinator.recorded import Recorded
from tests.decode.test_worker import admit_from, all_free, sleeper, workers
from tests.helpers import free_port


@pytest.fixture
def coord():
    # paths="remote": these are hand-offs (a 3-token prompt would take the LOCAL path by Dynamo's rule)
    c = Recorded(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", slo=False,
                                   handoff_timeout_s=5.0, paths="remote"))
    for ident, wid, role in ((b"P", "p", Role.PREFILL), (b"D", "d", Role.DECODE)):
        c.on_worker(ident, Hello(PROTOCOL_VERSION, wid, int(role), 1, "h", "b", "m", 256, 64, 16, kv_endpoint="tcp://127.0.0.1:1"))
    yield c
    c.release_sockets()


def prefilled(c: Recorded, rid: str, grant: int) -> str:
    """rid admitted, granted (grant number `grant`) and its Prefill sent; returns its internal id."""
    c.start_request(b"client", GenerateRequest(rid, SamplingParams(max_tokens=4), token_ids=[5, 6, 7]), [5, 6, 7])
    iid = c.taken(Admit)[-1][1].request_id
    c.on_worker(b"D", Granted(iid, [grant], 1, grant))
    assert c.taken(Prefill)[-1] == ("p", c.taken(Prefill)[-1][1]) and c.taken(Prefill)[-1][1].grant == grant
    return iid


def releases(c: Recorded) -> list:
    return [(wid, m.request_id, m.grant, m.prefill_sent) for wid, m in c.taken(Release)]


def test_a_hand_off_lost_after_prefill_done_fails_the_request_and_releases_its_grant(coord):
    iid = prefilled(coord, "lost", 7)
    coord.on_worker(b"P", PrefillDone(iid, 3, 100, 0.0, 0.0, 7))
    coord.handoff_timeouts(time.monotonic())
    assert not releases(coord) and iid in coord.requests  # within the timeout: the KVReady may still come
    coord.handoff_timeouts(time.monotonic() + 6)
    assert releases(coord) == [("d", iid, 7, False)]
    errors = [m for m in coord.to_clients if isinstance(m, ErrorReply)]
    assert [(e.request_id, e.code) for e in errors] == [("lost", "kv_transfer_failed")] and iid not in coord.requests
    # the Release reaches the decode worker before the request's Abort
    to_d = [type(m) for wid, m in coord.to_workers if wid == "d"]
    assert to_d.index(Release) < to_d.index(Abort)
    assert coord.counts["lost_handoffs"] == 1


def test_a_started_request_and_a_stale_prefill_done_are_left_alone(coord):
    started = prefilled(coord, "started", 3)
    coord.on_worker(b"P", PrefillDone(started, 3, 100, 0.0, 0.0, 3))
    coord.on_worker(b"D", TokenBatch([TokenOut(started, 9)]))  # its decode worker took the hand-off
    stale = prefilled(coord, "stale", 4)
    coord.on_worker(b"P", PrefillDone(stale, 3, 100, 0.0, 0.0, 99))  # names no grant of ours
    coord.handoff_timeouts(time.monotonic() + 6)
    assert not releases(coord) and started in coord.requests and stale in coord.requests


def test_a_request_that_ended_before_its_prefill_done_still_has_its_grant_released(coord):
    iid = prefilled(coord, "aborted", 5)
    coord.on_client(b"client", AbortRequest("aborted"))  # its decode grant is now cancelled, maybe fenced
    coord.on_worker(b"P", PrefillDone(iid, 3, 100, 0.0, 0.0, 5))
    coord.handoff_timeouts(time.monotonic() + 6)
    assert releases(coord) == [("d", iid, 5, False)]


def test_writer_records_of_ended_requests_are_forgotten(coord):
    iid = prefilled(coord, "gone", 6)
    coord.on_client(b"client", AbortRequest("gone"))  # its prefill job is aborted: no PrefillDone ever comes
    now = time.monotonic()
    coord.forget_gone_writers(now)
    assert iid in coord.writers
    coord.forget_gone_writers(now + 31)
    assert not coord.writers


def test_a_request_whose_worker_messages_would_outgrow_a_worker_socket_is_refused(coord):
    spec = "x" * (MAX_CONTROL_MESSAGE - 2**15)  # its GenerateRequest fits the client socket; its Prefill could not
    params = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", spec))
    coord.start_request(b"client", GenerateRequest("huge", params, token_ids=[5, 6, 7]), [5, 6, 7])
    assert [(e.request_id, e.code) for e in coord.to_clients] == [("huge", "limit_exceeded")]
    assert not coord.to_workers and not coord.requests


def test_released_without_a_writer_frees_a_live_or_cancelled_grant_while_its_writer_lives(tiny):
    writer = sleeper()
    try:
        _, d, _ = workers(tiny)
        for rid in ("live", "cancelled"):
            g = admit_from(d, rid, 20, writer.pid)
            if rid == "cancelled":
                d.link.inbox.append(Abort(rid))  # the client went away: the grant waits for its writer
            d.link.inbox.append(Release(rid, g.grant, prefill_sent=False))  # the writer reported PrefillDone
            d.turn(0)
        assert not d.grants and not d.fences and all_free(d)
        g = admit_from(d, "fenced", 20, writer.pid)
        d.link.inbox.append(Release("fenced", g.grant))  # writer silent: fenced
        d.turn(0)
        assert g.grant in d.fences
        d.link.inbox.append(Release("fenced", g.grant, prefill_sent=False))  # then it reported done
        d.turn(0)
        assert not d.fences and all_free(d)
    finally:
        writer.kill()
        writer.wait()
