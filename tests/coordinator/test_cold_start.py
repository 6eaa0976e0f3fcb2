"""Cold starts (coordinator/cold_start.py and its wiring in the coordinator, in one process with
its sends recorded): a request that finds no worker able to decode waits for one whatever its
TTFT target (refused only past the held-requests bound, with Retry-After the expected cold start),
its prompt checked against the model's own context before it is held; the worker's registration
is the measured cold start (stats `cold_start`, then the Retry-After), releases the request, whose
TTFT target counts from there (its trace says so); a request held past --cold-start-timeout-s is
refused; without cold starts it is refused at once (no_workers). The coordinator's stats list
the launch's workers not yet registered (`startup`)."""
import time

import pytest

from pdserve.coordinator.cold_start import TOKEN_BYTES, ColdStarts
from pdserve.coordinator.server import CoordinatorConfig
from pdserve.coordinator.state import Phase
from pdserve.coordinator.tracing import cold_start_attributes
from pdserve.wire.protocol import PROTOCOL_VERSION, Generate, Hello, Role, TokenBatch, TokenOut
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import ErrorReply, Final, FinishReason, GenerateRequest
from tests.coordinator.recorded import Recorded
from tests.helpers import free_port


def test_the_bounds_the_measurement_and_the_first_token():
    cold = ColdStarts(estimate_s=30.0, timeout_s=60.0, max_held=2, max_held_bytes=100 * TOKEN_BYTES)
    assert cold.expected_s() == 30.0  # the estimate until one is measured
    assert cold.hold("a", 60, now=10.0) is None and cold.started == 10.0
    assert "max-held-kb" in cold.hold("b", 41, now=11.0)  # 60 + 41 tokens' bytes: over the bytes bound
    assert cold.hold("b", 40, now=11.0) is None
    assert "max-held-requests 2" in cold.hold("c", 1, now=12.0)  # the count bound
    assert cold.hold("r", 1, now=12.0, bounded=False) is None  # a request placed again after its worker was lost
    assert cold.registered(now=17.5) == ["a", "b", "r"] and not cold.held and cold.started is None
    assert cold.expected_s() == 7.5 and cold.summary()["to_registered_s"] == [7.5]
    cold.first_token("b", now=18.0)  # not the first released: no measurement
    cold.first_token("a", now=19.0)
    assert cold.summary()["to_first_token_s"] == [9.0]
    assert cold.hold("d", 1, now=20.0) is None
    cold.forget("d")  # nobody waits any more: no cold start is measured
    assert cold.registered(now=40.0) == [] and cold.expected_s() == 7.5


def coordinator(**cfg) -> Recorded:
    return Recorded(CoordinatorConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", **cfg))


def register(c: Recorded, wid: str, role: Role) -> None:
    c.on_worker(wid.encode(), Hello(PROTOCOL_VERSION, wid, int(role), 1, "h", "b", "m", 2048, 64, 16, kv_endpoint="tcp://127.0.0.1:1"))


def start(c: Recorded, rid: str, n: int = 8) -> str | None:
    prompt = list(range(100, 100 + n))
    c.start_request(b"client", GenerateRequest(rid, SamplingParams(max_tokens=2), token_ids=prompt, priority=1), prompt)
    return c.by_client.get((b"client", rid))


def errors(c: Recorded) -> dict[str, ErrorReply]:
    return {m.request_id: m for m in c.to_clients if isinstance(m, ErrorReply)}


def test_a_request_waits_for_a_cold_start_and_its_ttft_target_counts_from_the_registration(closing):
    # class 1's TTFT target (1 s) is far under the 30 s estimate: before, it was refused at once (503 cold_start)
    c = coordinator(cold_start_s=30.0, max_held_requests=1, class_targets={1: (1000.0, 500.0)})
    closing(c)
    iid = start(c, "r1")
    assert iid is not None and c.requests[iid].phase is Phase.PENDING and not errors(c)
    assert c.stats()["requests"]["cold_start_waits"] == 1 and c.stats()["cold_start"]["held"] == 1
    assert start(c, "r2") is None  # the held-requests bound (1) is full: refused, retry after the estimate
    assert errors(c)["r2"].code == "cold_start" and errors(c)["r2"].retry_after_s == 30.0
    too_long = c.context_limit()  # no worker: the model's own context (its files), checked before holding
    assert too_long == 8192 and start(c, "r3", too_long) is None and errors(c)["r3"].code == "prompt_too_long"
    time.sleep(0.05)  # a cold start that takes some time to measure
    c.on_worker(b"p0", Hello(PROTOCOL_VERSION, "p0", int(Role.PREFILL), 1, "h", "b", "m", 2048, 64, 16, kv_endpoint="tcp://127.0.0.1:1"))
    assert c.stats()["cold_start"]["measured"] == 0  # a prefill worker alone cannot decode: the wait goes on
    register(c, "d0", Role.DECODE)
    cold = c.stats()["cold_start"]
    assert cold["measured"] == 1 and 0.05 <= cold["to_registered_s"][0] < 5 and c.stats()["cold_start_s"] == pytest.approx(cold["expected_s"], abs=1e-3)
    st = c.requests[iid]
    assert 0.05 <= st.cold_wait_s < 5
    c.retry_pending(time.monotonic())
    assert [m.request_id for _, m in c.taken(Generate)] == [iid]  # placed on the decode worker (LOCAL)
    assert cold_start_attributes(st) == {"pdserve.cold_start_wait_s": st.cold_wait_s, "pdserve.ttft_target_from": "worker_registered"}
    for i in range(2):
        c.on_worker(b"d0", TokenBatch([TokenOut(iid, 7, finish_reason=FinishReason.LENGTH if i else None)]))
    final = next(m for m in c.to_clients if isinstance(m, Final))
    assert final.ttft >= st.cold_wait_s  # the client sees its whole wait; its target counted the part after the registration
    assert c.stats()["cold_start"]["to_first_token_s"][0] >= cold["to_registered_s"][0]


def test_past_the_timeout_a_held_request_is_refused_with_the_measured_cold_start(closing):
    c = coordinator(cold_start_s=30.0, cold_start_timeout_s=0.5)
    closing(c)
    c.cold.to_registered.append(12.5)  # one measured before
    iid = start(c, "r1")
    c.retry_pending(time.monotonic())
    assert iid in c.requests and not errors(c)
    c.retry_pending(time.monotonic() + 1.0)
    assert iid not in c.requests and errors(c)["r1"].code == "cold_start" and errors(c)["r1"].retry_after_s == 12.5
    assert "cold-start-timeout-s 0.5" in errors(c)["r1"].message and c.stats()["requests"]["cold_start_timeouts"] == 1
    assert c.stats()["cold_start"]["held"] == 0


def test_without_cold_starts_a_request_with_no_worker_is_refused_at_once(closing):
    c = coordinator()
    closing(c)
    assert start(c, "r1") is None and errors(c)["r1"].code == "no_workers"
    assert c.stats()["cold_start_s"] == 0.0 and c.stats()["cold_start"] is None


def test_the_stats_list_the_launchs_workers_not_yet_registered(closing):
    c = coordinator(expected_workers=("local-decode-0", "local-decode-1", "local-prefill-0"))
    closing(c)
    register(c, "local-decode-0", Role.DECODE)
    assert c.stats()["startup"] == {"expected": 3, "awaiting": ["local-decode-1", "local-prefill-0"]}
    register(c, "local-prefill-0", Role.PREFILL)
    register(c, "local-decode-1", Role.DECODE)
    assert c.stats()["startup"]["awaiting"] == []
    c.drop_worker("local-decode-1", "test")
    assert c.stats()["startup"]["awaiting"] == []  # registered once: from then on readiness goes by roles
