"""Per-request timings -> the figures `vllm bench serve` prints, with its names and definitions.

Lifecycle: every request of a run leaves one `RequestOutput` (filled by a backend while it
streams); after the run `compute_metrics(outputs, duration, goodput_slos)` reduces them to a
`Metrics`, `format_metrics` renders the report in vLLM's order, and `result_dict` gives the
`--save-result` JSON. Definitions: TTFT = time to the first token; TPOT = (E2E - TTFT) /
(output tokens - 1), only for requests with more than one token (0 counts for goodput);
ITL = gaps between successive streamed chunks; goodput = requests/s that met every SLO given;
peak output tokens/s and peak concurrent requests over one-second buckets of the run. Which
latencies the report and JSON carry, and at which percentiles, follow `--percentile-metrics`
and `--metric-percentiles` (pdserve's default: all four at p90 and p99; vLLM's: ttft,tpot,itl at p99).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (90, 99)  # besides the mean, median and std every metric always has
ALL_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                   ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    prompt_len: int = 0
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks
    latency: float = 0.0  # seconds, send to last byte
    start_time: float = 0.0  # seconds since the run started
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class Metrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int | None = None
    # name -> {"mean": ms, "median": ms, "std": ms, "p90": ms, "p99": ms}, for the selected metrics
    latency_ms: dict = field(default_factory=dict)
    max_output_tokens_per_s: float = 0.0  # the busiest second of the run
    max_concurrent_requests: int = 0  # requests in flight in the busiest second


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, _, value = part.partition(":")
            if name not in SLO_NAMES or not value:
                raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(SLO_NAMES)}, got {part!r}")
            ms = float(value)
            if not ms > 0:
                raise ValueError(f"--goodput {name} must be > 0 ms, got {value}")
            slos[name] = ms
    return slos


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": vLLM's key and label spelling."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: list[float], percentiles=PERCENTILES) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(arr, p))
    return out


def peaks(ok: list[RequestOutput]) -> tuple[float, int]:
    """(most output tokens in one second, most requests in flight in one second), as vLLM
    buckets them: token times are start + ttft + the running sum of the gaps."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    n = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens, inflight = np.zeros(n), np.zeros(n)
    for o in ok:
        times = np.cumsum([o.start_time + o.ttft, *o.itl]) - t0
        np.add.at(tokens, np.clip(times.astype(int), 0, n - 1), 1)
        inflight[int(o.start_time - t0):int(o.start_time + o.latency - t0) + 1] += 1
    return float(tokens.max()), int(inflight.max())


def is_good(o: RequestOutput, slos_ms: dict[str, float]) -> bool:
    got = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}
    return all(got[name] * 1000.0 <= ms for name, ms in slos_ms.items())


def compute_metrics(outputs: list[RequestOutput], duration: float, slos_ms: dict[str, float] | None = None,
                    max_concurrency: int | None = None, metrics=ALL_METRICS, percentiles=PERCENTILES) -> Metrics:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    dur = max(duration, 1e-9)
    good = sum(is_good(o, slos_ms) for o in ok) / dur if slos_ms else None
    values = {
        "ttft": lambda: [o.ttft for o in ok],
        "tpot": lambda: [o.tpot for o in ok if o.output_tokens > 1],
        "itl": lambda: [g for o in ok for g in o.itl],
        "e2el": lambda: [o.latency for o in ok],
    }
    lat = {name: summarize(values[name](), percentiles) for name in ALL_METRICS if name in metrics}
    return Metrics(len(ok), len(outputs) - len(ok), duration, total_in, total_out, len(ok) / dur, good, total_out / dur,
                   (total_in + total_out) / dur, max_concurrency, lat, *peaks(ok))


def _line(label: str, value) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"


def format_metrics(m: Metrics, title: str = " Serving Benchmark Result ") -> str:
    lines = [f"{title:=^50}", _line("Successful requests:", m.completed), _line("Failed requests:", m.failed)]
    if m.max_concurrency:
        lines.append(_line("Maximum request concurrency:", m.max_concurrency))
    lines += [
        _line("Benchmark duration (s):", m.duration), _line("Total input tokens:", m.total_input),
        _line("Total generated tokens:", m.total_output), _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput))
    lines += [_line("Output token throughput (tok/s):", m.output_throughput),
              _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
              _line("Peak concurrent requests:", float(m.max_concurrent_requests)),
              _line("Total Token throughput (tok/s):", m.total_token_throughput)]
    for key, header, short in LATENCY_METRICS:
        if key not in m.latency_ms:
            continue
        s = m.latency_ms[key]
        lines.append(f"{header:-^50}")
        lines += [_line(f"Mean {short} (ms):", s["mean"]), _line(f"Median {short} (ms):", s["median"])]
        lines += [_line(f"{k.upper()} {short} (ms):", v) for k, v in s.items() if k.startswith("p")]
    lines.append("=" * 50)
    return "\n".join(lines)


def result_dict(m: Metrics, outputs: list[RequestOutput], config: dict) -> dict:
    """The --save-result document: vLLM's flat keys (mean_ttft_ms, p99_itl_ms, ...) plus per-request lists."""
    d = {k: v for k, v in asdict(m).items() if k != "latency_ms"}
    d["total_input_tokens"], d["total_output_tokens"] = d.pop("total_input"), d.pop("total_output")
    for key, stats in m.latency_ms.items():
        for stat, value in stats.items():
            d[f"{stat}_{key}_ms"] = value
    d.update(
        input_lens=[o.prompt_len for o in outputs], output_lens=[o.output_tokens for o in outputs],
        ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs], e2els=[o.latency for o in outputs],
        start_times=[o.start_time for o in outputs], generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
    )
    return {**config, **d}
