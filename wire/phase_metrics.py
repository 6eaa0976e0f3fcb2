"""Where each request's time went, per phase, as histograms: the coordinator measures, the
gateway's /metrics exports (vLLM's names under the pdserve prefix).

Phases of a request on a (prefill, decode) pair, on the coordinator's clock:
  queue        arrival -> its prefill forward starts: placement and the decode worker's KV
               grant, then the wait in the prefill worker's queue (the time from sending Prefill
               to PrefillDone, less the forward and the hand-off the worker reports; in a packed
               batch this includes waiting for the hand-offs of the prompts ahead of it)
  prefill      the prefill forward, as the prefill worker timed it
  kv transfer  the KV hand-off to the decode worker, as the prefill worker timed it (and bytes)
  first token  the rest of the TTFT: the decode worker taking the hand-off and the first token
               reaching the coordinator; queue + prefill + kv transfer + first token = TTFT
  decode       first token -> last token
  inference    first token's prefill start -> last token (vLLM: the time the request runs)
A colocated worker reports no split of its prompt's time: its requests feed decode only.

Lifecycle: the coordinator owns one `PhaseTracker`; `prefill_sent(iid)` when a Prefill goes out
(again on a retry), `prefill_done(iid, msg)` on PrefillDone, `finished(st)` when a request ends
normally (observes it, forgets it and returns its `PhaseSplit`), `forget(iid)` when it ends any other way.
A short request can end before its PrefillDone arrives (the prefill process sends it after the
hand-off and may be descheduled in between; measured on a loaded 2-core machine: 1 of 6
five-token requests): it is held as late (at most LATE_MAX, oldest dropped) and its phases are
observed when the PrefillDone comes, so every hand-off is counted once. `snapshot()`
goes into the coordinator's stats as "phases"; `families(stats, model)` turns a stats document
into Prometheus histograms (and the preemption counter) during a gateway scrape.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
BYTES = tuple(float(2**k) for k in range(12, 34, 2))  # 4 KiB .. 8 GiB
PHASES = {  # histogram (pdserve_NAME) -> (help, buckets)
    "request_queue_time_seconds": ("Time from arrival to the start of the prompt's forward (placement, KV grant, prefill queue)", SECONDS),
    "request_prefill_time_seconds": ("Time of the prompt's forward pass on the prefill worker", SECONDS),
    "request_kv_transfer_time_seconds": ("Time handing the prompt's KV cache from the prefill to the decode worker", SECONDS),
    "request_kv_transfer_bytes": ("Bytes of KV cache handed from the prefill to the decode worker per request", BYTES),
    "request_first_token_time_seconds": ("Rest of the TTFT after the hand-off: the decode worker taking it and the first token's delivery",
                                         SECONDS),
    "request_decode_time_seconds": ("Time from the first to the last output token", SECONDS),
    "request_inference_time_seconds": ("Time from the start of the prompt's forward to the last output token", SECONDS),
}


@dataclass
class _Times:
    prefill_sent: float | None = None
    done: float | None = None  # PrefillDone received
    compute_s: float = 0.0
    kv_s: float = 0.0
    kv_bytes: int = 0


@dataclass
class PhaseSplit:
    """One finished request's phases in seconds, back to back from its arrival: queue, prefill,
    kv_transfer, first_token (adding up to ttft), then decode. The TTFT parts are None for a
    colocated request (no split of its prompt's time)."""
    ttft: float
    decode: float
    queue: float | None = None
    prefill: float | None = None
    kv_transfer: float | None = None
    first_token: float | None = None
    kv_bytes: int = 0


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


LATE_MAX = 1024  # requests ended before their PrefillDone, held for it


class PhaseTracker:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.live: dict[str, _Times] = {}
        self.late: dict[str, tuple[_Times, float, PhaseSplit]] = {}  # iid -> its times, arrival, split
        self.hist = {name: Histogram(buckets) for name, (_, buckets) in PHASES.items()}

    def prefill_sent(self, iid: str) -> None:
        self.live[iid] = _Times(prefill_sent=self.clock())

    def prefill_done(self, iid: str, compute_s: float, kv_s: float, kv_bytes: int) -> None:
        t = self.live.get(iid)
        late = None if t is not None else self.late.pop(iid, None)
        t = late[0] if late is not None else t
        if t is None:
            return
        t.done, t.compute_s, t.kv_s, t.kv_bytes = self.clock(), compute_s, kv_s, kv_bytes
        if late is not None:
            self.observe(t, late[2], late[1])

    def forget(self, iid: str) -> None:
        self.live.pop(iid, None)

    def finished(self, iid: str, arrival: float, token_times: list[float]) -> PhaseSplit | None:
        """A request that ended with tokens (token_times: seconds since arrival): observe its
        phases and return them (None without tokens); the traces (coordinator/tracing.py) use the same split."""
        t = self.live.pop(iid, None)
        if not token_times:
            return None
        ttft, last = token_times[0], token_times[-1]
        split = PhaseSplit(ttft, last - ttft)
        self.hist["request_decode_time_seconds"].observe(split.decode)
        if t is None:
            return split  # colocated
        if t.done is None:  # its PrefillDone is still on the way: observed when it comes
            self.late[iid] = (t, arrival, split)
            while len(self.late) > LATE_MAX:
                self.late.pop(next(iter(self.late)))
            return split
        return self.observe(t, split, arrival)

    def observe(self, t: _Times, split: PhaseSplit, arrival: float) -> PhaseSplit:
        """Split split.ttft into the phases by t and observe them (split.decode is observed already)."""
        ttft = split.ttft
        # PrefillDone can arrive after the decode worker's first token (the prefill process sends it
        # after the hand-off, and may be descheduled in between): time past the first token is not waiting
        done = min(t.done, arrival + ttft)
        waited_at_worker = max(0.0, (done - t.prefill_sent) - t.compute_s - t.kv_s)
        queue = max(0.0, min(ttft, (t.prefill_sent - arrival) + waited_at_worker))
        prefill = max(0.0, min(t.compute_s, ttft - queue))
        kv = max(0.0, min(t.kv_s, ttft - queue - prefill))
        split.queue, split.prefill, split.kv_transfer, split.kv_bytes = queue, prefill, kv, t.kv_bytes
        split.first_token = max(0.0, ttft - queue - prefill - kv)
        for name, v in (("queue_time_seconds", queue), ("prefill_time_seconds", prefill), ("kv_transfer_time_seconds", kv),
                        ("first_token_time_seconds", split.first_token), ("inference_time_seconds", ttft + split.decode - queue)):
            self.hist[f"request_{name}"].observe(max(0.0, v))
        self.hist["request_kv_transfer_bytes"].observe(t.kv_bytes)
        return split

    def snapshot(self) -> dict:
        return {name: h.snapshot() for name, h in self.hist.items()}


def families(stats: dict, model: str):
    """Prometheus families from a coordinator stats document: the phase histograms and the
    preemptions the workers report."""
    for name, h in (stats.get("phases") or {}).items():
        if name not in PHASES:
            continue
        cumulative, total = [], 0
        for bound, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"]):
            total += n
            cumulative.append((bound, total))
        fam = HistogramMetricFamily(f"pdserve_{name}", PHASES[name][0], labels=["model_name"])
        fam.add_metric([model], cumulative, h["sum"])
        yield fam
    pre = CounterMetricFamily("pdserve_num_preemptions", "Sequences preempted (and recomputed) by workers short of KV blocks",
                              labels=["model_name", "worker"])
    for w in stats.get("workers", []):
        pre.add_metric([model, w["id"]], w.get("preemptions", 0))
    yield pre
