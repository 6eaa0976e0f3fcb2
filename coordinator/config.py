"""The coordinator's settings (`pdserve coordinator`'s flags): one dataclass, validated when
constructed; each field a flag sets declares that flag (common/flags.py), so pdserve/cli.py
builds the command's options from it.

Lifecycle: built once from the command line (or by tests), handed to `Coordinator`, then only
read. Importing it loads no model code and no sockets.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.flags import flag, insecure_flag, keys_flag
from pdserve.coordinator.paths import PathRule
from pdserve.coordinator.planner import PlannerConfig
from pdserve.coordinator.slo import SloTargets
from pdserve.wire.limits import RequestLimits

PATHS = ("auto", "remote", "local")


@dataclass
class CoordinatorConfig:
    client_addr: str = flag("tcp://127.0.0.1:5555", group="network", name="clients", launch=True, help="where clients connect")
    worker_addr: str = flag("tcp://127.0.0.1:5556", group="network", name="workers", launch=True, help="where workers connect")
    model: str | None = flag(None, group="model and weights", help="the model whose tokenizer to load")
    worker_timeout_s: float = flag(2.0, group="network", name="worker_timeout", help="seconds without a heartbeat before a worker is dropped")
    max_attempts: int = 3  # placements of one request (the first + retries after a lost worker)
    pending_timeout_s: float = flag(60.0, group="scheduling", name="pending_timeout",  # no decode worker could take it for this long: it fails
                                    help="seconds a request may wait for KV room before it is shed")
    admit_timeout_s: float = flag(10.0, group="scheduling", name="admit_timeout",  # (an Admit dropped by a full worker inbox)
                                  help="seconds a decode worker may leave an admission unanswered before the request is placed again")
    handoff_timeout_s: float = 5.0  # a hand-off reported done (PrefillDone) its decode worker has not started this long was lost
    slo: bool = flag(True, group="SLO", pair=True, launch=True, help="predict latency, place by it, shed what cannot meet the targets")
    # p99 targets of priority class 0: the default model on 2 CPU cores serves a burst of ~25 chat prompts
    # within 5 s and decodes ~48 streams within 0.5 s a token
    ttft_ms: float = flag(5000.0, group="SLO", name="ttft_p99_ms", launch=True, help="p99 time-to-first-token target (priority class 0)")
    tpot_ms: float = flag(500.0, group="SLO", name="tpot_p99_ms", launch=True, help="p99 time-per-output-token target (priority class 0)")
    class_targets: dict = flag(factory=dict, group="SLO", name="class_target", multiple=True, launch=True,  # priority -> (ttft_ms, tpot_ms)
                               help="PRIORITY:TTFT_MS:TPOT_MS targets of another priority class")
    ttft_headroom: float = 0.8  # admit against this fraction of the TTFT target: queueing predictions err low under load
    tpot_headroom: float = 0.9  # and of the TPOT target: a step time fitted from the worker's own steps errs less
    max_active_requests: int = flag(4096, group="scheduling", help="requests in flight before new ones are refused (overloaded)")
    max_client_requests: int = flag(1024, group="scheduling", help="the same, per client connection")  # the HTTP gateway is one client
    send_hwm: int = 100_000  # messages queued for one peer; a client that stops reading is dropped (send_client)
    # bytes queued for one client; past it its requests end client_too_slow (coordinator/outbox.py)
    client_send_budget: int = flag(32 * 2**20, group="network", name="client_send_budget_kb", scale=1024, min=64,
                                   help="KiB queued for one client that does not read, past which its requests are aborted (client_too_slow)")
    max_workers: int = 1024  # registered workers; a Hello beyond this is refused until one leaves
    keys: str | None = keys_flag(launch=True)  # required to bind beyond loopback
    insecure: bool = insecure_flag(launch=True)
    # export a span per request, a child per phase (coordinator/tracing.py)
    otlp_traces_endpoint: str | None = flag(None, group="tracing", launch=True,
                                            help="export a span per request (a child per phase) to this OTLP collector, e.g. http://127.0.0.1:4317")
    otlp_traces_protocol: str = flag("grpc", group="tracing", choices=("grpc", "http/protobuf"), envvar="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                     launch=True, help="OTLP transport of --otlp-traces-endpoint")
    served_model_name: str | None = flag(None, group="tracing", help="the model's name in the traces and stats (default: the file or directory name)")
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may carry (wire/limits.py)
    paths: str = flag("auto", group="paths and roles", choices=PATHS, launch=True,
                      help="auto: each request prefilled on its decode worker (local) or on a prefill worker (remote): with "
                      "SLO control the way that meets its targets, local first where the two share a node's cores (what "
                      "local refuses there, remote refuses too); without it local for short prompts or a long prefill "
                      "queue; remote: every request of a (prefill, decode) pair is prefilled on a prefill worker; local: "
                      "always on the decode worker")
    local_prefill_tokens: int = flag(PathRule.local_tokens, group="paths and roles", min=0, launch=True,
                                     help="without SLO control (--paths auto): prompts with at most this many uncached tokens are prefilled locally")
    # > 0: workers start on demand (`pdserve launch --ray`, --min-replicas 0): a request that finds none waits for one
    cold_start_s: float = flag(0.0, group="paths and roles", min=0, launch=True,
                               help="cold starts on: workers are started on demand (--ray with --min-replicas 0), and this is the "
                               "estimate of one (seconds from a request that finds no worker to a worker registered) until one "
                               "is measured; a request that finds no worker waits for one (--cold-start-timeout-s, "
                               "--max-held-requests, --max-held-kb), its TTFT target counted from the worker's registration; "
                               "0: refused at once (503 no_workers)")
    cold_start_timeout_s: float = flag(120.0, group="paths and roles", min=0, launch=True,
                                       help="with cold starts on: seconds a request waits for a worker before it is refused "
                                       "(503 cold_start, Retry-After the measured cold start)")
    max_held_requests: int = flag(256, group="paths and roles", min=0, launch=True,
                                  help="with cold starts on: requests that may wait for a worker at once; more are refused "
                                  "(503 cold_start, Retry-After the measured cold start)")
    max_held_bytes: int = flag(16 * 2**20, group="paths and roles", name="max_held_kb", scale=1024, min=0, launch=True,
                               help="with cold starts on: KiB of prompts (4 bytes a token) that may wait for a worker at once")
    # worker ids the launch that started this coordinator starts with it: not ready (stats `startup`) until each registered once
    expected_workers: tuple = flag(factory=tuple, group="network", name="expect_worker", multiple=True,
                                   help="a worker id the launch starts with this coordinator (repeat it): the stats say not ready "
                                   "(`startup`, the gateway's /health/ready) until each has registered once")
    # roles follow the load (SLO control on); None: fixed roles. On in the commands since 2026-12-03: on a 2-core node
    # it moves the idle prefill worker of a 1 + 1 launch to decode under overload, and two one-thread decode workers
    # serve 1.09-1.16x the goodput of one two-thread worker (docs/performance.md); in-process configs keep it off
    planner: PlannerConfig | None = flag(None, group="paths and roles", pair=True, command_default=True, launch=True,
                                         help="with SLO control, move workers that can switch role (prefill <-> decode) to the phase short "
                                         "of capacity (docs/architecture.md, Paths and roles); --no-planner: roles stay as launched")
    # the text of --chat-template (a file, or the template itself), used instead of the model's own (common/tokenizer.py)
    chat_template: str | None = flag(None, group="model and weights", launch=True,
                                     help="a Jinja chat template (a file, or the template itself) used instead of the model's own, e.g. one "
                                     "that shows tools")

    def __post_init__(self):
        if self.paths not in PATHS:
            raise ValueError(f"paths must be one of {', '.join(PATHS)}, got {self.paths!r}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")

    def targets(self, priority: int, ttft_ms: float = 0.0, tpot_ms: float = 0.0) -> SloTargets:
        base = self.class_targets.get(priority, (self.ttft_ms, self.tpot_ms))
        return SloTargets((ttft_ms or base[0]) / 1000, (tpot_ms or base[1]) / 1000)
