"""Which back-end (kernels.backends) multiplies each linear shape at each row count: measured on
this machine, checked against the twins first, cached on disk.

Lifecycle: at a worker's first start `choose(weights, buckets, candidates, ...)` takes one weight
of each shape (`shape_key`: out x in and weight kind), and for each row bucket binds every
candidate back-end, runs it once on random rows and compares it with its twin
(`disagreement` <= the back-end's tol; one that disagrees, or raises, is refused for that shape,
never timed, never chosen, and the log says so), then times the survivors round-robin (the
minimum of a few calls each: the machine may be shared, and the minimum is the uncontended
time). The fastest wins; one within TIE of the rules' choice (`default`) loses to it, so noise
does not flip the table. Time is bounded by `budget_s`: what is left when it runs out keeps the
rules' choice (logged). The `Table` is written as JSON under kernels.cpu_native.cache_dir(),
named by a hash of everything that can change the answer (CPU model and flags, thread count,
torch version, C sources, shapes, weight kinds, buckets, candidates): a start-up that finds it
does no timing. kernels.linear.PackedLinear then asks `Table.pick(key, rows)` per call.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.kernels import backends, cpu_native, quant

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # rows timed; a call takes the smallest bucket >= its rows (above 512: 512's)
BUDGET_S = 30.0  # the first start's measurement (the rules' choice for what is left): ~36 s measured whole on a 2-core Zen 4
TIE = 0.03  # a challenger must beat the rules' choice by more than this share
CALLS = 5  # timed calls per back-end and bucket (the minimum counts)
SLOW = 2.0  # a back-end this many times slower than the best after a round is not timed further
TABLE_VERSION = 1


def shape_key(weight) -> str:
    """'960x576 f32' or '960x576 Q4_1': what a table entry is for."""
    n, k = weight.shape
    return f"{n}x{k} {weight.qtype if isinstance(weight, quant.QuantTensor) else 'f32'}"


def disagreement(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w) -> float:
    """max |y - ref| over each output's scale, |x| @ |W|^T (the sum of its products' magnitudes);
    w: the weight, or its scale |x| @ |W|^T already computed."""
    if isinstance(w, torch.Tensor) and w.shape == ref.shape and w.dtype == torch.float64:
        scale = w
    else:
        dense = w.dequantize() if isinstance(w, quant.QuantTensor) else w
        scale = x.double().abs() @ dense.double().abs().T
    return float(((y.double() - ref).abs() / scale.clamp_min(1e-30)).max())


CHECK_COLUMNS = 384  # outputs the twin check computes for a wide weight: the first and last 64 (tile tails) and 256 spread between


def check_columns(n: int) -> torch.Tensor:
    if n <= CHECK_COLUMNS:
        return torch.arange(n)
    return torch.cat([torch.arange(64), torch.linspace(64, n - 65, CHECK_COLUMNS - 128).long(), torch.arange(n - 64, n)])


def _rows_of(w, cols: torch.Tensor):
    """The weight's output rows `cols` (what the twin multiplies by)."""
    return w.take_rows(cols) if isinstance(w, quant.QuantTensor) else w.index_select(0, cols)


@dataclass
class Table:
    """shape key -> [(bucket, back-end name)] ascending; refused: shape key -> {name: why}."""

    entries: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    refused: dict[str, dict[str, str]] = field(default_factory=dict)
    seconds: float = 0.0
    source: str = "measured"  # measured | cached

    def pick(self, key: str, rows: int) -> str | None:
        rows_backends = self.entries.get(key)
        if not rows_backends:
            return None
        for bucket, name in rows_backends:
            if rows <= bucket:
                return name
        return rows_backends[-1][1]

    def text(self) -> str:
        """One line per shape: runs of buckets with one back-end, e.g. '960x576 f32: 1-4 c, 8-64 onednn, 128+ mkl'."""
        lines = []
        for key, rows_backends in self.entries.items():
            runs, lo = [], 1
            for i, (bucket, name) in enumerate(rows_backends):
                last = i + 1 == len(rows_backends)
                if last or rows_backends[i + 1][1] != name:
                    runs.append(f"{lo}+ {name}" if last else (f"{lo}-{bucket} {name}" if lo != bucket else f"{bucket} {name}"))
                    lo = bucket + 1
            lines.append(f"{key}: {', '.join(runs)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"version": TABLE_VERSION, "entries": self.entries, "refused": self.refused, "seconds": self.seconds}

    @classmethod
    def from_json(cls, doc: dict) -> Table:
        return cls({k: [(int(b), str(n)) for b, n in v] for k, v in doc["entries"].items()}, doc.get("refused", {}),
                   float(doc.get("seconds", 0)), "cached")


def _min_time(run, x, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        run(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _checked(key: str, weight, bucket: int, candidates, refused: dict, bound: dict) -> dict:
    """name -> run for the candidates that bind here and agree with their twin on random rows of
    this bucket (on check_columns of the outputs: the twin runs in float64)."""
    g = torch.Generator().manual_seed(bucket)
    x = torch.randn(bucket, weight.shape[1], generator=g)
    cols = check_columns(weight.shape[0])
    part = _rows_of(weight, cols)
    dense = part.dequantize() if isinstance(part, quant.QuantTensor) else part
    scale = x.double().abs() @ dense.double().abs().T
    runs, twins = {}, {}
    for b in candidates:
        if b.name in refused or b.max_rows < bucket:
            continue
        try:
            if b.name not in bound:
                bound[b.name] = b.bind(weight)
            run = bound[b.name]
            if run is None:
                continue
            if b.twin not in twins:
                twins[b.twin] = b.twin(x, part)
            err = disagreement(run(x)[:, cols], twins[b.twin], x, scale)  # the call also warms it (oneDNN's primitive)
        except (RuntimeError, ValueError, MemoryError) as e:
            err, why = None, f"failed at {bucket} rows: {type(e).__name__}: {str(e)[:120]}"
        else:
            why = f"disagrees with its twin at {bucket} rows: {err:.2e} > {b.tol:.0e}"
        if err is None or not err <= b.tol:  # NaN disagrees too
            refused[b.name] = why
            log.warning("linear back-end %s refused for %s: %s", b.name, key, why)
            continue
        runs[b.name] = run
    return runs


def _time_bucket(runs: dict, rows: int, k: int, default: str | None) -> str:
    """The fastest of runs at this many rows: round-robin calls (a noisy moment hits every
    back-end alike), the minimum of each; one over SLOW x the best so far stops being timed."""
    x = torch.randn(rows, k)
    best = {name: float("inf") for name in runs}
    live = dict(runs)
    for _ in range(CALLS):
        for name, run in live.items():
            best[name] = min(best[name], _min_time(run, x, 1))
        top = min(best.values())
        live = {n: r for n, r in live.items() if best[n] <= SLOW * top or n == default}
    winner = min(best, key=best.get)
    if default in best and best[default] <= best[winner] * (1 + TIE):
        return default
    return winner


def choose(weights: dict[str, object], buckets: dict[str, list[int]], candidates: dict[str, tuple],
           default: Callable[[str, int], str], budget_s: float = BUDGET_S) -> Table:
    """Measure: weights, one per shape key; buckets and candidate back-ends per key; default(key,
    rows): the rules' choice, kept on ties and where the budget ran out."""
    start = time.perf_counter()
    table = Table()
    for key, weight in weights.items():
        refused, bound, rows_backends = {}, {}, []
        for bucket in buckets[key]:
            runs = {}
            if time.perf_counter() - start <= budget_s:
                runs = _checked(key, weight, bucket, candidates[key], refused, bound)
            elif not table.refused.get("(budget)"):
                table.refused["(budget)"] = {"all": f"the {budget_s:.0f} s budget ran out at {key}, {bucket} rows"}
                log.warning("linear back-end selection: the %.0f s budget ran out at %s, %d rows: the rules' choice from there", budget_s, key, bucket)
            if not runs:
                rows_backends.append((bucket, default(key, bucket)))
                continue
            with torch.inference_mode():
                rows_backends.append((bucket, _time_bucket(runs, bucket, weight.shape[1], default(key, bucket))))
        table.entries[key] = rows_backends
        if refused:
            table.refused[key] = refused
        bound.clear()  # the packed copies made for timing
    table.seconds = round(time.perf_counter() - start, 2)
    return table


def cache_key(parts: dict) -> str:
    """A hash of the machine, torch, the C sources and `parts` (shapes, buckets, candidates)."""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    sources = Path(__file__).parent / "csrc"
    doc = {"cpu": cpu, "flags": sorted(backends.cpu_flags()), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "c": hashlib.sha256(b"".join(p.read_bytes() for p in sorted(sources.glob("*.[ch]")))).hexdigest(),
           "version": TABLE_VERSION, **parts}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def cached(name: str, key: str, measure: Callable[[], dict]) -> tuple[dict, bool]:
    """The JSON document cache_dir()/name-key.json, made by measure() when absent; (doc, was cached).
    Written to a private name and renamed under an flock of name-key.lock: workers starting together
    measure once and never read half a file."""
    path = cpu_native.cache_dir() / f"{name}-{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        lock = None
    with lock or contextlib.nullcontext():
        if lock is not None:  # the workers of one launch start together: one measures, the others wait and read its table
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _read_or_measure(path, measure)


def _read_or_measure(path: Path, measure: Callable[[], dict]) -> tuple[dict, bool]:
    try:
        return json.loads(path.read_text()), True
    except (OSError, ValueError):
        pass
    doc = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot cache %s: %s", path, e)
    return doc, False
