"""Prometheus metrics of the HTTP gateway (`GET /metrics`), named after vLLM's (`vllm:X` is
`pdserve_X` here: Prometheus keeps colons for recording rules) so that existing dashboards carry
over. The exposition passes `promtool check metrics`: no `_created` series, and the coordinator's
sliding-window percentiles are gauges named per percentile (`..._p99_seconds`), not `quantile`
labels, which only a summary may carry.

Every series carries the `model_name` label of the served model it belongs to (a gateway may serve
several, each behind its own coordinator: gateway/models.py).

Lifecycle: one `GatewayMetrics` per gateway, with its own registry. As each request ends the
gateway observes it through its model's view (`of(model)`): `observe(result)` feeds the TTFT,
TPOT, inter-token and end-to-end histograms and the token and finish-reason counters;
`error(code)` and `aborted()` count the other endings. The cluster's state (queues, running
batches, KV cache usage, KV bytes and seconds transferred, the paths requests took, the prompts
and prompt tokens scored, the latency model's prediction error and admission headroom, the
planner's role changes) lives in each model's coordinator: `render(*stats)` takes the stats
snapshots the gateway just fetched (one per model, in the models' order), and a collector turns
them into gauges and counters during that scrape, each family once with every model's samples.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.wire.phase_metrics import families as phase_families
from pdserve_client.library import Result

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, with finer low ends: a small model on a CPU answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
PERCENTILES = ("p50", "p90", "p99")  # of the coordinator's sliding windows: one gauge family each


def percentile_gauges(name: str, doc: str, labels: list[str], unit: str = "") -> dict[str, GaugeMetricFamily]:
    """One gauge family per percentile, `{name}_{p}{unit}` (a `quantile` label is a summary's alone)."""
    return {p: GaugeMetricFamily(f"{name}_{p}{unit}", f"{doc} ({p})", labels=labels) for p in PERCENTILES}


class GatewayMetrics:
    def __init__(self, *models: str):
        disable_created_metrics()  # process-wide, as vLLM does: no `<counter>_created` series beside each counter and histogram
        self.models = models
        self.registry = CollectorRegistry(auto_describe=True)
        self.cluster = ClusterCollector(models)
        self.registry.register(self.cluster)
        m, r = ["model_name"], self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token, as the gateway sees it", m, registry=r, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean time per output token after the first, per request", m, registry=r,
            buckets=TPOT_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between consecutive output tokens", m, registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "End-to-end request latency", m, registry=r, buckets=E2E_BUCKETS)
        self.prompt_len = Histogram("pdserve_request_prompt_tokens", "Prompt tokens per request", m, registry=r, buckets=TOKEN_BUCKETS)
        self.output_len = Histogram("pdserve_request_generation_tokens", "Generated tokens per request", m, registry=r, buckets=TOKEN_BUCKETS)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens of finished requests", m, registry=r)
        self.finished = Counter("pdserve_request_success", "Requests that ended, by finish reason", m + ["finished_reason"], registry=r)
        self.errors = Counter("pdserve_request_errors", "Requests that failed, by error type", m + ["error_type"], registry=r)

    def of(self, model: str) -> ModelMetrics:
        """What one model's requests are counted through."""
        return ModelMetrics(self, model)

    def error(self, code: str, model: str | None = None) -> None:
        """A request that failed before its model was known counts under the first model."""
        self.errors.labels(model or self.models[0], code).inc()

    def render(self, *stats: dict | None) -> bytes:
        self.cluster.snapshots = stats
        return generate_latest(self.registry)


class ModelMetrics:
    """The request metrics of one served model (what a Fanout observes as its requests end)."""

    def __init__(self, metrics: GatewayMetrics, model: str):
        self.metrics, self.model = metrics, model

    def observe(self, r: Result) -> None:
        g, m = self.metrics, self.model
        ttft = r.client_ttft if r.client_ttft is not None else r.ttft
        g.finished.labels(m, r.finish_reason or "unknown").inc()
        g.prompt_tokens.labels(m).inc(r.prompt_tokens)
        g.generation_tokens.labels(m).inc(r.completion_tokens)
        g.prompt_len.labels(m).observe(r.prompt_tokens)
        g.output_len.labels(m).observe(r.completion_tokens)
        g.e2e.labels(m).observe(r.latency)
        if r.completion_tokens:
            g.ttft.labels(m).observe(ttft)
        if r.completion_tokens > 1:
            g.tpot.labels(m).observe(max(0.0, r.latency - ttft) / (r.completion_tokens - 1))
        itl = g.itl.labels(m)
        for a, b in zip(r.token_times, r.token_times[1:]):
            itl.observe(b - a)

    def error(self, code: str) -> None:
        self.metrics.error(code, self.model)

    def aborted(self) -> None:
        self.metrics.finished.labels(self.model, "abort").inc()


class ClusterCollector(Collector):
    """Gauges and counters mirrored from each model's coordinator stats (None: it did not answer),
    each family once with the samples of every model (promtool refuses a family written twice)."""

    def __init__(self, models: tuple[str, ...]):
        self.models = models
        self.snapshots: tuple[dict | None, ...] = ()

    def describe(self):
        return []  # the families depend on the snapshot; described at collection

    def collect(self):
        merged = {}
        for model, s in zip(self.models, self.snapshots):
            for fam in CoordinatorFamilies(model).families(s):
                if fam.name in merged:
                    merged[fam.name].samples += fam.samples
                else:
                    merged[fam.name] = fam
        yield from merged.values()


class CoordinatorFamilies:
    """One model's coordinator stats as Prometheus families, each sample labelled with the model."""

    def __init__(self, model: str):
        self.model = model

    def families(self, s: dict | None):
        up = GaugeMetricFamily("pdserve_coordinator_up", "1 if the model's coordinator answered this scrape", labels=["model_name"])
        up.add_metric([self.model], 1.0 if s is not None else 0.0)
        yield up
        if s is None:
            return
        yield from self._workers(s.get("workers", []))
        yield from self._coordinator(s)
        yield from phase_families(s, self.model)

    def _workers(self, workers: list[dict]):
        labels = ["model_name", "worker", "role"]
        fams = {
            "running": GaugeMetricFamily("pdserve_num_requests_running", "Sequences in a worker's running batch", labels=labels),
            "queue": GaugeMetricFamily("pdserve_num_requests_waiting", "Sequences waiting in a worker's queue", labels=labels),
            "queued_tokens": GaugeMetricFamily("pdserve_num_queued_tokens", "Prompt tokens queued at a worker", labels=labels),
        }
        usage = GaugeMetricFamily("pdserve_kv_cache_usage_perc", "Fraction of a worker's KV blocks in use (1 = full)", labels=labels)
        count = GaugeMetricFamily("pdserve_num_workers", "Registered workers by role", labels=["model_name", "role"])
        prefix = {  # vLLM's prefix_cache_queries / prefix_cache_hits (tokens), per worker
            "queries": CounterMetricFamily("pdserve_prefix_cache_queries", "Prompt tokens looked up in a worker's prefix cache", labels=labels),
            "hits": CounterMetricFamily("pdserve_prefix_cache_hits", "Prompt tokens found in a worker's prefix cache", labels=labels),
            "cached_blocks": GaugeMetricFamily("pdserve_prefix_cache_blocks", "KV blocks registered in a worker's prefix cache", labels=labels),
        }
        tier = {  # the node's host KV tier as each worker uses it (kvtransfer.host_tier; vLLM's CPU offload metrics)
            "queries": CounterMetricFamily("pdserve_kv_host_tier_queries", "Prompt tokens a worker looked up in its node's host KV tier "
                                           "(full blocks past its prefix cache's hit)", labels=labels),
            "hits": CounterMetricFamily("pdserve_kv_host_tier_hits", "Prompt tokens a worker loaded from its node's host KV tier", labels=labels),
            "hit_rate": GaugeMetricFamily("pdserve_kv_host_tier_hit_rate", "host KV tier hits / queries of a worker since its start",
                                          labels=labels),
            "bytes_in": CounterMetricFamily("pdserve_kv_host_tier_bytes_in", "KV bytes a worker put into its node's host KV tier "
                                            "(blocks its prefix cache evicted)", labels=labels),
            "bytes_out": CounterMetricFamily("pdserve_kv_host_tier_bytes_out", "KV bytes a worker loaded from its node's host KV tier",
                                             labels=labels),
            "blocks": GaugeMetricFamily("pdserve_kv_host_tier_blocks", "KV blocks its node's host KV tier holds", labels=labels),
            "capacity": GaugeMetricFamily("pdserve_kv_host_tier_capacity_blocks", "KV blocks its node's host KV tier can hold",
                                          labels=labels),
        }
        by_role: dict[str, int] = {}
        for w in workers:
            key = [self.model, w["id"], w["role"]]
            for name, fam in fams.items():
                fam.add_metric(key, w.get(name, 0))
            for name, fam in prefix.items():
                fam.add_metric(key, w.get("prefix_cache", {}).get(name, 0))
            for name, fam in tier.items():
                fam.add_metric(key, w.get("host_tier", {}).get(name, 0))
            usage.add_metric(key, 1.0 - w["free_blocks"] / max(1, w["total_blocks"]))
            by_role[w["role"]] = by_role.get(w["role"], 0) + 1
        for role in ("prefill", "decode", "colocated"):
            count.add_metric([self.model, role], by_role.get(role, 0))
        yield from (*fams.values(), usage, count, *prefix.values(), *tier.values())

    def _coordinator(self, s: dict):
        m = [self.model]
        kv = s.get("kv_transfer", {})
        for name, key, doc in (("kv_transfer_bytes", "bytes", "KV cache bytes handed from prefill to decode workers"),
                               ("kv_transfer_seconds", "seconds", "Seconds spent handing KV cache from prefill to decode workers"),
                               ("kv_transfer_handoffs", "handoffs", "Prefill-to-decode KV hand-offs")):
            fam = CounterMetricFamily(f"pdserve_{name}", doc, labels=["model_name"])
            fam.add_metric(m, kv.get(key, 0))
            yield fam
        requests = s.get("requests", {})
        for name, doc in (("scored_prompts", "Prompts scored (prompt_logprobs): each once per distinct prompt of an HTTP request"),
                          ("scored_prompt_tokens", "Prompt tokens scored: each computed, none taken from the prefix cache")):
            fam = CounterMetricFamily(f"pdserve_{name}", doc, labels=["model_name"])
            fam.add_metric(m, requests.get(name, 0))
            yield fam
        pending = GaugeMetricFamily("pdserve_num_requests_pending", "Requests the coordinator holds until a decode worker has room", labels=["model_name"])
        pending.add_metric(m, s.get("pending", 0))
        active = GaugeMetricFamily("pdserve_num_requests_active", "Requests the coordinator is serving", labels=["model_name"])
        active.add_metric(m, s.get("active_requests", 0))
        yield pending
        yield active
        yield from self._slo(s.get("slo", {}))
        yield from self._paths(s.get("requests", {}))
        yield from self._calibration(s.get("calibration", {}))
        yield from self._planner(s.get("planner", {}))

    def _paths(self, counts: dict):
        """Requests placed per path (remote: prefill worker + hand-off; local: prefilled on its
        decode worker) and per reason the path was chosen (coordinator/paths.py)."""
        fams = {"path": CounterMetricFamily("pdserve_request_path", "Requests placed, by the path they took", labels=["model_name", "path"]),
                "path_reason": CounterMetricFamily("pdserve_request_path_reason", "Requests placed, by why their path was chosen",
                                                   labels=["model_name", "reason"])}
        for key, n in counts.items():
            kind, _, value = key.partition(":")
            if kind in fams and value:
                fams[kind].add_metric([self.model, value], n)
        yield from fams.values()

    def _calibration(self, cal: dict):
        """Per phase: the latency model's relative prediction error percentiles (positive: it
        predicted too low) and the share of the target admission holds predictions to."""
        err = percentile_gauges("pdserve_prediction_error", "(observed - predicted) / predicted over recent requests, per phase",
                                ["model_name", "phase"])
        headroom = GaugeMetricFamily("pdserve_admission_headroom", "Share of the target a prediction must meet to be admitted, per phase",
                                     labels=["model_name", "phase"])
        by_path = percentile_gauges("pdserve_path_prediction_error", "(observed - predicted) / predicted per path (local, remote) and phase",
                                    ["model_name", "path", "phase"])
        for phase, c in cal.items():
            if phase == "paths":
                for path, phases in c.items():
                    for ph, x in phases.items():
                        add_percentiles(by_path, [self.model, path, ph], x.get("error", {}) if isinstance(x, dict) else {})
                continue
            add_percentiles(err, [self.model, phase], c.get("error", {}))
            headroom.add_metric([self.model, phase], c.get("headroom", 1.0))
        yield from err.values()
        yield headroom
        yield from by_path.values()

    def _planner(self, planner: dict):
        """Role changes the planner started (from, to), and its other events (switched, confirmed,
        refused, drains called off, changes held back and why)."""
        changes = CounterMetricFamily("pdserve_role_changes", "Role changes started by the planner", labels=["model_name", "from", "to"])
        events = CounterMetricFamily("pdserve_planner_events", "Planner events: drains switched, confirmed, refused, called off, held",
                                     labels=["model_name", "event"])
        for key, n in planner.get("counts", {}).items():
            old, to, new = key.partition("_to_")
            if to:
                changes.add_metric([self.model, old, new], n)
            else:
                events.add_metric([self.model, key], n)
        yield changes
        yield events

    def _slo(self, slo: dict):
        """The coordinator's sliding-window p50/p90/p99 TTFT and TPOT per priority class, its
        targets, prediction error and sheds (SLO control)."""
        m = [self.model]
        fams = {kind: percentile_gauges(f"pdserve_slo_{kind}", f"Coordinator-measured {kind.upper()} over a sliding window, per priority class",
                                        ["model_name", "priority"], "_seconds") for kind in ("ttft", "tpot")}
        for prio, kinds in slo.get("classes", {}).items():
            for kind, window in kinds.items():
                add_percentiles(fams[kind], [self.model, prio], window)
        for kind in fams.values():
            yield from kind.values()
        for kind in ("ttft", "tpot"):
            target = GaugeMetricFamily(f"pdserve_slo_{kind}_target_seconds", f"p99 {kind.upper()} target of priority class 0", labels=["model_name"])
            target.add_metric(m, slo.get(f"{kind}_ms", 0.0) / 1000)
            yield target
        err = slo.get("ttft_prediction_error", {})
        if "p50" in err:
            fam = GaugeMetricFamily("pdserve_slo_ttft_prediction_error", "Median |predicted - actual| / actual TTFT", labels=["model_name"])
            fam.add_metric(m, err["p50"])
            yield fam
        shed = CounterMetricFamily("pdserve_slo_shed_requests", "Requests shed because their targets could not be met", labels=["model_name", "priority"])
        for prio, n in slo.get("shed", {}).items():
            shed.add_metric([self.model, prio], n)
        yield shed


def add_percentiles(fams: dict[str, GaugeMetricFamily], labels: list[str], window: dict) -> None:
    """A window's percentiles ({"p50": .., ...}, those it has) into their gauge families."""
    for p, fam in fams.items():
        if p in window:
            fam.add_metric(labels, window[p])
