"""A request's phases in the coordinator: the table of allowed moves (coordinator/state.py's
TRANSITIONS) on plain data, `RequestState.move` as the only way to change a phase, and the
coordinator reporting a move outside the table (counted, logged) without changing what it does.
The flows themselves run through the strict `Recorded` coordinator in the other tests here, which
fails on any move outside the table."""
import logging

import pytest

from pdserve.coordinator.counts import Count, Counts
from pdserve.coordinator.server import Coordinator, CoordinatorConfig
from pdserve.coordinator.state import TRANSITIONS, Phase, RequestState
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import FinishReason, GenerateRequest
from tests.coordinator.recorded import Recorded
from tests.helpers import free_port

REMOTE = [Phase.ADMITTING, Phase.PREFILLING, Phase.DECODING]  # Admit, Granted -> Prefill, first token
LOCAL = [Phase.COLOCATED]  # Generate on a colocated worker, or a decode worker's LOCAL path
REFUSED = [Phase.ADMITTING, Phase.PENDING, Phase.NEW, Phase.ADMITTING]  # AdmitRefused parks it; room frees; admitted again


def request() -> RequestState:
    return RequestState("r0-e", b"c", "r0", [1, 2, 3], GenerateRequest("r0", SamplingParams(), token_ids=[1, 2, 3]), 0.0, None)


def walk(phases: list[Phase]) -> list[bool]:
    st = request()
    return [st.move(p) for p in phases]


def test_the_table_covers_every_phase_and_every_placed_or_parked_request_can_be_retried():
    assert set(TRANSITIONS) == set(Phase)
    for phase, nexts in TRANSITIONS.items():
        assert phase not in nexts, phase  # staying put is not a move
        assert phase is Phase.NEW or Phase.NEW in nexts, phase  # a retry (lost worker, unanswered Admit) starts over
    reached, frontier = {Phase.NEW}, [Phase.NEW]
    while frontier:
        for p in TRANSITIONS[frontier.pop()] - reached:
            reached.add(p)
            frontier.append(p)
    assert reached == set(Phase)


def test_the_paths_a_request_takes_are_allowed_and_others_are_not():
    for path in (REMOTE, LOCAL, REFUSED, [Phase.PENDING, Phase.NEW, *LOCAL], [*REMOTE[:2], Phase.NEW, *REMOTE]):
        assert all(walk(path)), path
    for wrong in ([Phase.PREFILLING], [Phase.DECODING], [Phase.PENDING, Phase.ADMITTING], [Phase.COLOCATED, Phase.DECODING],
                  [Phase.ADMITTING, Phase.DECODING], [*REMOTE, Phase.PREFILLING]):
        assert not walk(wrong)[-1], wrong


def test_move_is_the_only_way_to_change_a_phase():
    st = request()
    assert st.phase is Phase.NEW and st.move(Phase.ADMITTING) and st.phase is Phase.ADMITTING
    assert not st.move(Phase.DECODING) and st.phase is Phase.DECODING  # reported by the caller, moved all the same
    with pytest.raises(AttributeError):
        st.phase = Phase.NEW
    assert [p for p in Phase if p.on_workers] == [Phase.ADMITTING, Phase.PREFILLING, Phase.COLOCATED, Phase.DECODING]


def test_counts_keep_their_exported_names():
    c = Counts()
    c.add(Count.REQUESTS)
    c.add(Count.REQUESTS)
    c.error("overloaded")
    c.finished(FinishReason.ABORT)
    c.placed("remote", "fixed")
    assert c.snapshot() == {"requests": 2, "error:overloaded": 1, "finished:abort": 1, "path:remote": 1, "path_reason:fixed": 1}
    assert c["retries"] == 0 and "retries" not in c.snapshot()  # a counter shows once it has counted


def test_the_coordinator_reports_a_move_outside_the_table(caplog):
    c = Recorded(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"))
    try:
        st = request()
        with caplog.at_level(logging.ERROR, logger="pdserve.coordinator"):
            Coordinator.move(c, st, Phase.ADMITTING)
            assert c.counts["illegal_transitions"] == 0 and not caplog.records
            Coordinator.move(c, st, Phase.COLOCATED)  # (Recorded.move would fail the test here)
        assert st.phase is Phase.COLOCATED and c.stats()["requests"]["illegal_transitions"] == 1
        assert "bug: request r0-e moved ADMITTING -> COLOCATED" in caplog.text
    finally:
        c.release_sockets()
