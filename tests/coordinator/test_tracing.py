"""OpenTelemetry traces (`--otlp-traces-endpoint`). Through real processes: `pdserve launch`
exports to an OTLP receiver started in this test (gRPC, vLLM's default protocol, for a
(prefill, decode) pair; http/protobuf for a colocated worker), as a user's collector would
receive them: each request sent to the HTTP gateway arrives as one `llm_request` span, inside
the client's round trip on the wall clock, whose children are its phases, back to back, naming
the workers from `pdserve stats`, and adding up to the request's span within 10%. The exact
timestamps and the spans of failed requests are checked with the SDK's in-memory exporter on a
fake clock.
Without OpenTelemetry installed the coordinator imports cleanly, and the flag is a usage error
naming what to install."""
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.coordinator.tracing import RequestTracer
from pdserve.wire.phase_metrics import PhaseSplit
from tests.gateway.helpers import poll
from tests.helpers import free_port, save_tiny_served_model
from tests.serving.test_launcher import pdserve, wait_ready

PAIR_PHASES = ["queue", "prefill", "kv_transfer", "first_token", "decode"]
N = 4
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"  # a client's own trace (W3C trace context)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    save_tiny_served_model(d)
    return d


class Receiver:
    """An OTLP trace receiver in this process: every span exported to it, as (resource attributes, span proto)."""

    def __init__(self):
        self.spans = []
        self.lock = threading.Lock()

    def take(self, request) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                self.spans += [(resource, s) for ss in rs.scope_spans for s in ss.spans]

    def roots(self):
        with self.lock:
            return [s for _, s in self.spans if s.name == "llm_request"]


def grpc_receiver():
    """(receiver, endpoint, stop): the OTLP TraceService over gRPC on a loopback port."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    rec = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            rec.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return rec, f"http://127.0.0.1:{port}", lambda: server.stop(grace=None)


def http_receiver():
    """(receiver, endpoint, stop): OTLP/HTTP protobuf at /v1/traces on a loopback port."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            if ok:
                rec.take(ExportTraceServiceRequest.FromString(body))
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()

    return rec, f"http://127.0.0.1:{server.server_address[1]}/v1/traces", stop


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.mark.parametrize("protocol, receiver, colocated", [("grpc", grpc_receiver, False), ("http/protobuf", http_receiver, True)])
def test_launch_exports_a_span_tree_per_request(model_dir, tmp_path, protocol, receiver, colocated, monkeypatch):
    """gRPC on a (prefill, decode) pair with --served-model-name; http/protobuf on a colocated worker (one launch each)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the SDK's batch processor exports every 0.2 s, not every 5 s
    rec, endpoint, stop_receiver = receiver()
    name = model_dir.name if colocated else "traced-tiny"
    clients, workers, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    proc = pdserve("launch", "--model", str(model_dir), "--clients", clients, "--workers", workers, "--threads", "1",
                   "--http-port", str(http), "--log-dir", str(tmp_path), "--kv-cache-mb", "16",
                   # --paths remote: the pair's span tree is a hand-off's (these short prompts would be prefilled locally)
                   *(["--colocated"] if colocated else ["--served-model-name", name, "--paths", "remote"]),
                   "--otlp-traces-endpoint", endpoint, "--otlp-traces-protocol", protocol)
    try:
        stats = wait_ready(proc, clients, 1 if colocated else 2)
        ids = {w["role"]: w["id"] for w in stats["workers"]}
        poll(lambda: httpx.get(f"http://127.0.0.1:{http}/health/ready", timeout=5).status_code == 200, timeout=60)
        sent = {}
        for i in range(N):
            t0 = time.time_ns()
            r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60, headers={"traceparent": TRACEPARENT} if i == 0 else {},
                           json={"model": name, "prompt": f"Request {i} wants a few tokens.", "max_tokens": 6, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
            sent[r.json()["id"]] = (t0, time.time_ns())
        roots = poll(lambda: (lambda got: got if len(got) >= N else None)(rec.roots()), timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        stop_receiver()
    assert proc.returncode == 0
    assert len(roots) == N
    with rec.lock:
        spans = list(rec.spans)
    assert {res["service.name"] for res, _ in spans} == {"pdserve"}
    first_sent = min(t0 for t0, _ in sent.values())
    for root in roots:
        a = attributes(root)
        rid = a["gen_ai.request.id"].rsplit("-", 1)[0]  # the gateway's response id + "-" + choice index
        assert rid in sent, a
        t0, t1 = sent.pop(rid)
        assert t0 <= root.start_time_unix_nano <= root.end_time_unix_nano <= t1  # inside the HTTP round trip, on the wall clock
        if t0 == first_sent:  # the request sent with a traceparent joined the client's trace
            assert (root.trace_id.hex(), root.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
        else:
            assert len(root.parent_span_id) == 0 and root.trace_id.hex() != TRACE_ID
        assert (a["gen_ai.usage.completion_tokens"], a["pdserve.finish_reason"], a["gen_ai.response.model"]) == (6, "length", name)
        kids = sorted((s for _, s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano)
        assert all(k.trace_id == root.trace_id for k in kids)
        if colocated:
            assert "pdserve.prefill_worker" not in a and a["pdserve.decode_worker"] == ids["colocated"]
            assert (a["pdserve.path"], a["pdserve.path_reason"]) == ("local", "colocated")
            assert [(k.name, attributes(k)["pdserve.worker_id"]) for k in kids] == [("prefill", ids["colocated"]), ("decode", ids["colocated"])]
        else:
            assert (a["pdserve.prefill_worker"], a["pdserve.decode_worker"]) == (ids["prefill"], ids["decode"])
            assert (a["pdserve.path"], a["pdserve.path_reason"]) == ("remote", "fixed") and a["pdserve.remote_ttft_ms"] > 0
            assert [k.name for k in kids] == PAIR_PHASES
            assert [attributes(k)["pdserve.worker_id"] for k in kids] == [ids["prefill"]] * 3 + [ids["decode"]] * 2
            assert attributes(kids[2])["pdserve.kv.bytes"] > 0 and attributes(kids[2])["pdserve.kv.destination"] == ids["decode"]
            assert kids[1].end_time_unix_nano - kids[1].start_time_unix_nano > 0  # the prompt's forward took time
        assert kids[0].start_time_unix_nano == root.start_time_unix_nano
        for a_, b_ in zip(kids, kids[1:]):
            assert abs(b_.start_time_unix_nano - a_.end_time_unix_nano) <= 1  # back to back (ns rounding)
        total = sum(k.end_time_unix_nano - k.start_time_unix_nano for k in kids)
        e2e = root.end_time_unix_nano - root.start_time_unix_nano
        assert abs(total - e2e) <= 0.1 * e2e, (total, e2e)
    assert not sent


class InMemory:
    def __enter__(self):
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.exporter = InMemorySpanExporter()
        self.tracer = RequestTracer(self.exporter, batch=False, clock_offset_ns=0)
        return self

    def __exit__(self, *exc):
        self.tracer.shutdown()

    def tree(self):
        spans = self.exporter.get_finished_spans()
        roots = [s for s in spans if s.name == "llm_request"]
        return {r.attributes["gen_ai.request.id"]: (r, sorted((s for s in spans if s.parent and s.parent.span_id == r.context.span_id),
                                                              key=lambda s: s.start_time)) for r in roots}


def test_colocated_and_failed_requests_on_a_fake_clock():
    from opentelemetry.trace import StatusCode

    with InMemory() as m:
        pair = PhaseSplit(ttft=0.5, decode=1.0, queue=0.1, prefill=0.3, kv_transfer=0.05, first_token=0.05, kv_bytes=4096)
        m.tracer.request(10.0, 11.52, pair, "p0", "d0", {"gen_ai.request.id": "pair"})
        m.tracer.request(20.0, 21.0, PhaseSplit(ttft=0.4, decode=0.6), None, "c0", {"gen_ai.request.id": "colocated"})
        m.tracer.request(30.0, 30.2, None, "p0", "d0", {"gen_ai.request.id": "failed", "pdserve.finish_reason": "error"},
                         error="worker_lost: worker d0 was lost", trace_headers={"traceparent": TRACEPARENT})
        m.tracer.request(40.0, 40.1, None, None, None, {"gen_ai.request.id": "bad parent"}, trace_headers={"traceparent": "00-nonsense"})
        tree = m.tree()
    root, kids = tree["pair"]
    assert [k.name for k in kids] == PAIR_PHASES
    assert [(k.start_time, k.end_time) for k in kids] == [
        (10_000_000_000, 10_100_000_000), (10_100_000_000, 10_400_000_000), (10_400_000_000, 10_450_000_000),
        (10_450_000_000, 10_500_000_000), (10_500_000_000, 11_500_000_000)]
    assert (root.start_time, root.end_time) == (10_000_000_000, 11_520_000_000)
    assert root.attributes["gen_ai.latency.time_in_queue"] == 0.1 and root.attributes["gen_ai.latency.e2e"] == pytest.approx(1.52)
    assert [k.attributes["pdserve.worker_id"] for k in kids] == ["p0", "p0", "p0", "d0", "d0"]
    root, kids = tree["colocated"]
    assert [(k.name, k.attributes["pdserve.worker_id"]) for k in kids] == [("prefill", "c0"), ("decode", "c0")]
    assert kids[0].attributes["pdserve.includes_queue"] is True and "pdserve.prefill_worker" not in root.attributes
    assert root.status.status_code == StatusCode.UNSET
    root, kids = tree["failed"]
    assert kids == [] and root.status.status_code == StatusCode.ERROR and root.status.description == "worker_lost: worker d0 was lost"
    assert (f"{root.context.trace_id:032x}", f"{root.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
    root, kids = tree["bad parent"]
    assert f"{root.context.trace_id:032x}" != TRACE_ID  # an unreadable traceparent starts a new trace


BLOCK_OTEL = "import sys; sys.modules['opentelemetry'] = None; "  # as if the otel extra were not installed


def test_without_opentelemetry_the_coordinator_imports_and_the_flag_is_a_usage_error():
    check = ("import pdserve.coordinator.server, coordinator.tracing as t\n"
             "assert not [m for m in sys.modules if m.startswith('opentelemetry.')]\n"
             "try:\n    t.exporter_class('grpc')\nexcept t.TracingUnavailable as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", BLOCK_OTEL + check], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'pdserve[otel]'" in out.stdout
    launch = ("from pdserve.cli import main; main(['launch', '--otlp-traces-endpoint', 'http://127.0.0.1:4317', '--no-gateway',"
              f" '--clients', 'tcp://127.0.0.1:{free_port()}', '--workers', 'tcp://127.0.0.1:{free_port()}'])")
    out = subprocess.run([sys.executable, "-c", BLOCK_OTEL + launch], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--otlp-traces-endpoint needs OpenTelemetry" in out.stderr and "pdserve[otel]" in out.stderr
    assert "pdserve ready" not in out.stderr


def test_tracing_off_imports_no_opentelemetry():
    out = subprocess.run([sys.executable, "-c", "import sys, coordinator.server, pdserve.cli; "
                          "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_is_gone_does_not_hold_the_coordinator_at_exit(protocol):
    """Nothing listens at the endpoint: the exporter would retry for ~8 s; shutdown waits FLUSH_TIMEOUT_S at most."""
    from pdserve.coordinator.tracing import FLUSH_TIMEOUT_S

    endpoint = f"http://127.0.0.1:{free_port()}" + ("/v1/traces" if protocol == "http/protobuf" else "")
    tracer = RequestTracer.otlp(endpoint, protocol)
    now = time.monotonic()
    tracer.request(now - 1.0, now, PhaseSplit(ttft=0.5, decode=0.5), None, "c0", {"gen_ai.request.id": "lost"})
    t0 = time.monotonic()
    tracer.shutdown()
    assert time.monotonic() - t0 < FLUSH_TIMEOUT_S + 1.0


def test_span_attributes_and_trace_headers_are_bounded():
    """A caller's 1 MiB request id, error text or tracestate cannot bloat a span: values are cut to
    MAX_ATTRIBUTE_LENGTH characters (also the SDK's span limit), an oversized trace header is ignored."""
    from opentelemetry.trace import StatusCode

    from pdserve.coordinator.tracing import MAX_ATTRIBUTE_LENGTH

    huge = "x" * 2**20
    with InMemory() as m:
        assert m.tracer.provider._span_limits.max_span_attribute_length == MAX_ATTRIBUTE_LENGTH
        split = PhaseSplit(ttft=0.4, decode=0.6)
        m.tracer.request(1.0, 2.0, split, None, huge, {"gen_ai.request.id": huge}, error=huge,
                         trace_headers={"traceparent": TRACEPARENT, "tracestate": "a=" + huge})
        m.tracer.request(3.0, 4.0, None, None, None, {"gen_ai.request.id": "joined"},
                         trace_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
        spans = m.exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "llm_request" and s.attributes["gen_ai.request.id"].startswith("x"))
    assert root.attributes["gen_ai.request.id"] == "x" * MAX_ATTRIBUTE_LENGTH
    assert root.attributes["pdserve.decode_worker"] == "x" * MAX_ATTRIBUTE_LENGTH
    assert root.status.status_code == StatusCode.ERROR and len(root.status.description) == MAX_ATTRIBUTE_LENGTH
    assert all(len(str(v)) <= MAX_ATTRIBUTE_LENGTH for s in spans for v in s.attributes.values())
    assert f"{root.context.trace_id:032x}" == TRACE_ID and len(root.context.trace_state) == 0  # the oversized tracestate is ignored
    joined = next(s for s in spans if s.attributes.get("gen_ai.request.id") == "joined")
    assert f"{joined.context.trace_id:032x}" == TRACE_ID and dict(joined.context.trace_state) == {"vendor": "1"}
