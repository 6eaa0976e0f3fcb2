"""Where TTFT went: the coordinator's per-phase histograms on the gateway's /metrics, for
requests on a (prefill, decode) pair of real processes on loopback. Every finished request is
counted once in each phase; queue + prefill + KV hand-off + first token add up to the TTFT the
coordinator reported for it; the hand-off bytes equal the coordinator's KV transfer total. The
arithmetic of the split (clamps, colocated requests, forgotten ones) is checked on a fake clock."""
import pytest

from pdserve.wire.phase_metrics import LATE_MAX, PhaseTracker
from pdserve_client import Client
from tests.gateway.helpers import poll, scrape, start_gateway_cluster, value
from tests.helpers import save_tiny_served_model

N = 6
TTFT_PHASES = ("queue_time", "prefill_time", "kv_transfer_time", "first_token_time")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    # --paths remote: the split is a hand-off's (by default these short prompts take the LOCAL path)
    launcher = start_gateway_cluster(d, tmp_path_factory.mktemp("logs"), engine_args=["--kv-cache-mb", "16"],
                                     coordinator_args=["--paths", "remote"])
    yield launcher
    launcher.stop()


def test_phase_histograms_add_up_to_the_ttft(service):
    with Client(service.plan.client_addr, timeout=60) as c:
        results = [c.generate(prompt=f"Request number {i} asks for a few tokens.", max_tokens=5, ignore_eos=True, temperature=0)
                   for i in range(N)]
        assert all(r.completion_tokens == 5 for r in results)
        samples, types = poll(lambda: (lambda s: s if value(s[0], "pdserve_request_decode_time_seconds_count") == N else None)(
            scrape(service.plan.http_url)))
        # the coordinator's total counts a hand-off when the prefill worker reports it sent, which may come after the
        # request's last token reached this client (a 5-token answer): wait for it to count all N
        kv_bytes = poll(lambda: (lambda b: b if b == value(samples, "pdserve_request_kv_transfer_bytes_sum") else None)(
            c.stats()["kv_transfer"]["bytes"]))
    for phase in (*TTFT_PHASES, "decode_time", "inference_time"):
        name = f"pdserve_request_{phase}_seconds"
        assert types[name] == "histogram"
        assert value(samples, f"{name}_count") == N, phase
        assert value(samples, f"{name}_bucket", le="+Inf") == N
    for phase in ("queue_time", "prefill_time", "kv_transfer_time", "decode_time"):
        assert value(samples, f"pdserve_request_{phase}_seconds_sum") > 0, phase
    phase_total = sum(value(samples, f"pdserve_request_{p}_seconds_sum") for p in TTFT_PHASES)
    assert phase_total == pytest.approx(sum(r.ttft for r in results), rel=1e-6)
    decode_total = value(samples, "pdserve_request_decode_time_seconds_sum")
    assert decode_total == pytest.approx(sum(r.token_times[-1] - r.token_times[0] for r in results), rel=1e-6)
    assert value(samples, "pdserve_request_kv_transfer_bytes_sum") == kv_bytes > 0
    assert value(samples, "pdserve_request_kv_transfer_bytes_count") == N
    assert value(samples, "pdserve_request_path_total", path="remote") == N
    assert value(samples, "pdserve_request_path_reason_total", reason="fixed") == N
    assert types["pdserve_num_preemptions"] == "counter"
    assert {dict(labels)["worker"] for (n, labels) in samples if n == "pdserve_num_preemptions_total"} == {"t-prefill-0", "t-decode-0"}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_split_on_a_fake_clock():
    clock = Clock()
    tr = PhaseTracker(clock)
    arrival = 100.0
    clock.t = 100.5  # 0.5 s placing it and waiting for the KV grant
    tr.prefill_sent("a")
    clock.t = 101.5  # PrefillDone 1 s later: 0.6 s forward, 0.1 s hand-off, so 0.3 s in the worker's queue
    tr.prefill_done("a", compute_s=0.6, kv_s=0.1, kv_bytes=4096)
    tr.finished("a", arrival, token_times=[1.7, 1.9, 2.7])  # TTFT 1.7 s: 0.2 s after the hand-off
    snap = tr.snapshot()

    def total(name):
        return snap[f"request_{name}"]["sum"]

    assert total("queue_time_seconds") == pytest.approx(0.8)
    assert total("prefill_time_seconds") == pytest.approx(0.6)
    assert total("kv_transfer_time_seconds") == pytest.approx(0.1)
    assert total("first_token_time_seconds") == pytest.approx(0.2)
    assert total("decode_time_seconds") == pytest.approx(1.0)
    assert total("inference_time_seconds") == pytest.approx(2.7 - 0.8)
    assert total("kv_transfer_bytes") == 4096 and sum(snap["request_kv_transfer_bytes"]["counts"]) == 1
    assert not tr.live

    # the first token reached the coordinator before PrefillDone did: the parts are clamped to the TTFT
    tr.prefill_sent("b")
    clock.t = 101.0
    tr.prefill_done("b", compute_s=0.9, kv_s=0.05, kv_bytes=1)
    tr.finished("b", 100.0, token_times=[0.95])
    snap2 = tr.snapshot()
    parts = [snap2[f"request_{p}_seconds"]["sum"] - snap[f"request_{p}_seconds"]["sum"] for p in TTFT_PHASES]
    assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(0.95)

    tr.finished("colocated", 100.0, token_times=[0.1, 0.3])  # never handed off: decode time only
    tr.prefill_sent("aborted")
    tr.forget("aborted")
    snap3 = tr.snapshot()
    assert sum(snap3["request_decode_time_seconds"]["counts"]) == 3
    assert sum(snap3["request_queue_time_seconds"]["counts"]) == 2 and not tr.live


def test_a_request_that_ended_before_its_prefill_done_is_observed_when_it_comes():
    # a 5-token request can finish on the decode worker before the prefill process's PrefillDone
    # reaches the coordinator (seen once in the full suite: queue_time counted 5 of 6 requests)
    clock = Clock()
    tr = PhaseTracker(clock)
    tr.prefill_sent("a")  # at 100.0, its arrival
    tr.finished("a", 100.0, token_times=[0.5, 0.6, 0.9])
    snap = tr.snapshot()
    assert sum(snap["request_queue_time_seconds"]["counts"]) == 0 and sum(snap["request_decode_time_seconds"]["counts"]) == 1
    tr.forget("a")  # the server forgets it when it closes: the late record stays
    clock.t = 101.2
    tr.prefill_done("a", compute_s=0.3, kv_s=0.1, kv_bytes=64)
    snap = tr.snapshot()
    parts = [snap[f"request_{p}_seconds"]["sum"] for p in TTFT_PHASES]
    assert all(sum(snap[f"request_{p}_seconds"]["counts"]) == 1 for p in TTFT_PHASES)
    assert sum(parts) == pytest.approx(0.5)  # the TTFT, split
    assert snap["request_inference_time_seconds"]["sum"] == pytest.approx(0.9 - snap["request_queue_time_seconds"]["sum"])
    assert sum(snap["request_decode_time_seconds"]["counts"]) == 1 and not tr.late and not tr.live
    tr.prefill_done("a", compute_s=0.3, kv_s=0.1, kv_bytes=64)  # a duplicate counts nothing more
    assert sum(tr.snapshot()["request_queue_time_seconds"]["counts"]) == 1
    for i in range(LATE_MAX + 5):  # PrefillDones that never come: the oldest records go
        tr.prefill_sent(f"r{i}")
        tr.finished(f"r{i}", 100.0, token_times=[0.1])
    assert len(tr.late) == LATE_MAX and "r0" not in tr.late
