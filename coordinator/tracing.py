"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`), exported by the coordinator: the
one process that sees every request from arrival to its last token, and already splits its time
into phases for the histograms (wire/phase_metrics.py).

Each request that ends becomes one span `llm_request` (vLLM's name and `gen_ai.*` attributes,
plus the workers it ran on and its path: `pdserve.path`, `pdserve.path_reason` and each way's
predicted TTFT and TPOT, `pdserve.remote_ttft_ms` ... `pdserve.local_tpot_ms`) with a child span per phase, back to back: `queue`, `prefill`,
`kv_transfer`, `first_token`, `decode` on a (prefill, decode) pair, each carrying the id of the
worker it happened on (`pdserve.worker_id`); on a colocated worker `prefill` (its queue wait
included: the worker reports no split) and `decode`. A request that failed or was aborted gets
the root span only, its status ERROR (failed) with the error code. A request that came with a
W3C `traceparent` (the HTTP gateway passes the header on) joins that trace, as in vLLM. Spans carry the
coordinator's own timestamps (its monotonic clock mapped to wall time once), so they are
written after the fact, when the request ends, and never on the hot path of a token. What a
caller controls cannot bloat a span: every string attribute (the request id, worker ids) and an
error status's description are cut to MAX_ATTRIBUTE_LENGTH characters here (quietly: the SDK's
own span limits, kept as a backstop, log a warning per cut), and a trace header longer than
MAX_TRACE_HEADER is ignored.

Lifecycle: `RequestTracer.otlp(endpoint, protocol)` builds a tracer provider with a batch span
processor and an OTLP exporter (grpc, as vLLM defaults to, or http/protobuf); the coordinator
calls `ended(request_state, ...)` as each request ends (`request(...)` takes the same as plain
values) and `shutdown()` when it stops (flushes what is queued, bounded). OpenTelemetry is an optional
extra (`pip install 'pdserve[otel]'`): nothing of it is imported until a tracer is built, and
building one without it raises `TracingUnavailable` naming the package to install.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from pdserve.wire.phase_metrics import PhaseSplit

if TYPE_CHECKING:
    from pdserve.coordinator.state import RequestState

PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = "pip install 'pdserve[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"
FLUSH_TIMEOUT_S = 3.0  # at shutdown: a collector that does not answer must not hold the coordinator's exit
MAX_ATTRIBUTE_LENGTH = 256  # characters of a span attribute or error description (a request id is a caller's string)
MAX_TRACE_HEADER = 512  # characters of a traceparent or tracestate read (W3C: a tracestate of up to 512 is kept); a longer one is ignored


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint was given but OpenTelemetry is not installed."""


def exporter_class(protocol: str = "grpc"):
    """The OTLP span exporter class of `protocol`; raises TracingUnavailable without OpenTelemetry."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(f"--otlp-traces-endpoint needs OpenTelemetry ({e.name or e} is missing): {INSTALL_HINT}") from None
    return OTLPSpanExporter


def span_exporter(endpoint: str, protocol: str = "grpc"):
    """An OTLP span exporter for `endpoint` (grpc: `host:4317` or `http://host:4317`;
    http/protobuf: the full URL, `http://host:4318/v1/traces`)."""
    return exporter_class(protocol)(endpoint=endpoint)


class RequestTracer:
    def __init__(self, exporter, batch: bool = True, clock_offset_ns: int | None = None):
        """`exporter`: an OpenTelemetry SpanExporter (OTLP, or the SDK's in-memory one in tests);
        batch=False exports each span as it ends. clock_offset_ns maps the coordinator's
        time.monotonic() seconds to epoch nanoseconds (default: measured now)."""
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.trace = trace
        limits = SpanLimits(max_span_attribute_length=MAX_ATTRIBUTE_LENGTH)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}), span_limits=limits,
                                       shutdown_on_exit=False)  # shutdown() bounds it
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdserve.coordinator")
        self.offset_ns = time.time_ns() - time.monotonic_ns() if clock_offset_ns is None else clock_offset_ns

    @classmethod
    def otlp(cls, endpoint: str, protocol: str = "grpc") -> RequestTracer:
        return cls(span_exporter(endpoint, protocol))

    def _ns(self, monotonic_s: float) -> int:
        return self.offset_ns + int(monotonic_s * 1e9)

    def request(self, arrival: float, end: float, split: PhaseSplit | None, prefill: str | None, decode: str | None,
                attributes: dict, error: str | None = None, trace_headers: dict | None = None) -> None:
        """One ended request: arrival and end on the coordinator's monotonic clock; split: its
        phases (None: no tokens, aborted or failed); error: "code: message" if it failed;
        trace_headers: the client's W3C traceparent (and tracestate): the span joins that trace."""
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attrs = {k: v for k, v in attributes.items() if v is not None}
        attrs.update({k: v for k, v in (("pdserve.prefill_worker", prefill), ("pdserve.decode_worker", decode)) if v})
        attrs = {k: v[:MAX_ATTRIBUTE_LENGTH] if isinstance(v, str) else v for k, v in attrs.items()}
        prefill, decode = (w[:MAX_ATTRIBUTE_LENGTH] if w else w for w in (prefill, decode))
        if split is not None:
            attrs.update(_latency_attributes(split, end - arrival))
        headers = {k: v for k, v in (trace_headers or {}).items() if k in ("traceparent", "tracestate") and len(v) <= MAX_TRACE_HEADER}
        parent = TraceContextTextMapPropagator().extract(headers) if headers else None  # invalid: a new trace
        root = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER, start_time=self._ns(arrival), attributes=attrs)
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error[:MAX_ATTRIBUTE_LENGTH]))
        if split is not None:
            ctx = self.trace.set_span_in_context(root)
            t = arrival
            for name, seconds, worker, extra in _phases(split, prefill, decode):
                span = self.tracer.start_span(name, context=ctx, start_time=self._ns(t),
                                              attributes={"pdserve.worker_id": worker or "", **extra})
                t += seconds
                span.end(end_time=self._ns(t))
        root.end(end_time=self._ns(max(end, arrival)))

    def ended(self, st: RequestState, outcome: str, split: PhaseSplit | None, model: str, error: str | None = None,
              end: float | None = None) -> None:
        """A coordinator request that ended at `end` (monotonic; default now): outcome is its
        finish reason, or "error"."""
        p = st.req.params
        self.request(st.arrival, time.monotonic() if end is None else end, split, st.prefill, st.decode, {
            "gen_ai.request.id": st.client_rid, "gen_ai.response.model": model, "gen_ai.request.n": 1,
            "gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
            "gen_ai.usage.prompt_tokens": len(st.prompt), "gen_ai.usage.completion_tokens": len(st.tokens),
            "pdserve.finish_reason": outcome, "pdserve.attempts": st.attempts, "pdserve.priority": st.priority,
            **{f"pdserve.{k}": v for k, v in st.path.items()}, **cold_start_attributes(st),
        }, error, st.req.trace_headers)

    def shutdown(self) -> None:
        """Export what is queued and stop, waiting at most FLUSH_TIMEOUT_S (with its collector
        gone the exporter retries for ~8 s; what is left then is dropped with the process)."""
        stop = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        stop.start()
        stop.join(FLUSH_TIMEOUT_S)


def cold_start_attributes(st: RequestState) -> dict:
    """A request held for a cold start: how long it waited for a worker, and that its TTFT target
    counts from that worker's registration (arrival + the wait), not from its arrival."""
    if not st.cold_wait_s:
        return {"pdserve.ttft_target_from": "arrival"}
    return {"pdserve.cold_start_wait_s": st.cold_wait_s, "pdserve.ttft_target_from": "worker_registered"}


def _phases(s: PhaseSplit, prefill: str | None, decode: str | None):
    """(span name, seconds, worker, extra attributes) of each phase, in order."""
    if s.queue is None:  # colocated: one worker, no split of the time to the first token
        return [("prefill", s.ttft, decode, {"pdserve.includes_queue": True}), ("decode", s.decode, decode, {})]
    return [
        ("queue", s.queue, prefill, {}),
        ("prefill", s.prefill, prefill, {}),
        ("kv_transfer", s.kv_transfer, prefill, {"pdserve.kv.bytes": s.kv_bytes, "pdserve.kv.destination": decode or ""}),
        ("first_token", s.first_token, decode, {}),
        ("decode", s.decode, decode, {}),
    ]


def _latency_attributes(s: PhaseSplit, e2e: float) -> dict:
    """vLLM's latency attributes of its llm_request span, in seconds."""
    out = {"gen_ai.latency.time_to_first_token": s.ttft, "gen_ai.latency.e2e": e2e, "gen_ai.latency.time_in_model_decode": s.decode}
    if s.queue is not None:
        out.update({"gen_ai.latency.time_in_queue": s.queue, "gen_ai.latency.time_in_model_prefill": s.prefill,
                    "gen_ai.latency.time_in_model_inference": s.ttft - s.queue + s.decode})
    return out
