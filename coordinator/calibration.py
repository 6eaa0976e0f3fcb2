"""How wrong the latency predictions are, and the admission headroom that follows from it.
Plain classes, no sockets and no clock.

Lifecycle: when a request's first token is out the coordinator records its predicted TTFT (from
its placement Decision) next to the observed one and its targets (`record_ttft`), and its TPOT
when it ends (`record_tpot`). Each phase keeps the last `window`
errors e = (observed - predicted) / max(predicted, floor * target) (positive: the model
under-predicted). Before each placement it asks `targets(base, ttft_headroom, tpot_headroom)`
for what a prediction must meet:
with fewer than `min_samples` errors the static headroom (CoordinatorConfig.ttft_headroom /
tpot_headroom), then, per phase, target / (1 + k * q) with q the `quantile` of the
under-predictions, clamped to [floor, static]. Why: observed = predicted + e * max(predicted,
floor * target), so a request admitted at predicted <= target / (1 + q) is within target unless
its error is beyond the quantile (for predictions below floor * target too, as long as q <= 1 /
floor - 1, which the clamp to the floor assumes). Under overload admission fills up to the limit,
so the admitted requests' predictions crowd at it: for p99 targets the quantile is the 99th.
The errors only ever tighten the static headroom, never loosen it: a 99th percentile of 20-256
errors, measured on a load that changes, is an estimate, and the first requests of a cold start
(served before any queue formed) are over-predicted: loosening on them would raise the headroom
to the whole target just before the burst they precede.

Why errors against max(predicted, floor * target) and not the prediction alone: part of the error
does not scale with the prediction (a prompt that lands mid-step waits out the rest of a prefill
and of a decode step); relative to a short prediction it looks huge and pinned the headroom to
the floor for nothing (docs/performance.md, "Figures behind design choices").
`summary` exports the error percentiles and the headroom in use (stats, /metrics).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from pdserve.coordinator.slo import SloTargets


@dataclass(frozen=True)
class CalibrationConfig:
    window: int = 256  # errors kept per phase (as many as a StepModel keeps steps)
    min_samples: int = 20  # fewer: the static headroom (the 99th percentile of 20 is their largest: conservative)
    quantile: float = 99.0  # of the under-predictions: p99 targets
    k: float = 1.0  # headroom per unit of that error
    floor: float = 0.5  # never admit against less than half the target: past that the model is what to fix;
    # also the share of the target an error is measured against when the prediction is smaller


class ErrorTracker:
    """The last `window` relative errors of one prediction."""

    def __init__(self, window: int):
        self.errors: collections.deque = collections.deque(maxlen=window)

    def add(self, predicted: float | None, observed: float | None, least: float = 0.0) -> None:
        """Keep (observed - predicted) / max(predicted, least)."""
        if predicted is None or observed is None or not (predicted > 0 and math.isfinite(predicted) and math.isfinite(observed)):
            return
        self.errors.append((observed - predicted) / max(predicted, least))

    def under(self, quantile: float) -> float:
        """The quantile of the errors, 0 when the model over-predicts there."""
        return max(0.0, float(np.percentile(np.fromiter(self.errors, dtype=np.float64), quantile)))

    def percentiles(self) -> dict:
        if not self.errors:
            return {"count": 0}
        p50, p90, p99 = np.percentile(np.fromiter(self.errors, dtype=np.float64), [50, 90, 99])
        return {"count": len(self.errors), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


class Calibration:
    """The errors of all requests, and of each path's (coordinator/paths.py: "remote", "local")
    apart: a path with errors of its own (min_samples of them) is admitted against its own headroom."""

    def __init__(self, cfg: CalibrationConfig = CalibrationConfig()):
        self.cfg = cfg
        self.ttft = ErrorTracker(cfg.window)
        self.tpot = ErrorTracker(cfg.window)
        self.paths: dict[str, tuple[ErrorTracker, ErrorTracker]] = {}

    def record_ttft(self, predicted: float | None, observed: float | None, path: str | None = None,
                    targets: SloTargets | None = None) -> None:
        """A TTFT error, as soon as the first token is out (a request's end may be tens of seconds
        later: under overload that left admission on the static headroom for a whole 20 s run);
        `targets` (the request's own) set the least scale of its error (floor * target)."""
        for tracker in self._trackers(path, 0):
            tracker.add(predicted, observed, self.cfg.floor * targets.ttft_s if targets is not None else 0.0)

    def record_tpot(self, predicted: float | None, observed: float | None, path: str | None = None,
                    targets: SloTargets | None = None) -> None:
        """A finished request's TPOT error (see record_ttft)."""
        for tracker in self._trackers(path, 1):
            tracker.add(predicted, observed, self.cfg.floor * targets.tpot_s if targets is not None else 0.0)

    def _trackers(self, path: str | None, phase: int) -> list[ErrorTracker]:
        """The pooled tracker of a phase (0 TTFT, 1 TPOT) and, for a path, that path's own."""
        pairs = [(self.ttft, self.tpot)]
        if path is not None:
            pairs.append(self.paths.setdefault(path, (ErrorTracker(self.cfg.window), ErrorTracker(self.cfg.window))))
        return [pair[phase] for pair in pairs]

    def factor(self, tracker: ErrorTracker, static: float) -> float:
        """The share of a target a prediction must meet: static until min_samples errors, then
        what the errors call for, never above static nor below the floor."""
        if len(tracker.errors) < self.cfg.min_samples:
            return static
        return min(static, max(self.cfg.floor, 1.0 / (1.0 + self.cfg.k * tracker.under(self.cfg.quantile))))

    def trackers(self, path: str | None) -> tuple[ErrorTracker, ErrorTracker]:
        """The path's own (TTFT, TPOT) errors where it has min_samples of each, else all requests'."""
        own = self.paths.get(path)
        if own is not None and min(len(own[0].errors), len(own[1].errors)) >= self.cfg.min_samples:
            return own
        return self.ttft, self.tpot

    def targets(self, base: SloTargets, ttft_headroom: float, tpot_headroom: float, path: str | None = None) -> SloTargets:
        """base less the headroom: what a request's predictions must meet to be admitted (on `path`)."""
        ttft, tpot = self.trackers(path)
        return SloTargets(base.ttft_s * self.factor(ttft, ttft_headroom), base.tpot_s * self.factor(tpot, tpot_headroom))

    def summary(self, ttft_headroom: float, tpot_headroom: float) -> dict:
        """Per phase: the relative error percentiles (signed; positive under-predicts) and the headroom
        in use; under "paths", each path's own errors and the headroom its admissions use."""
        def phases(errors: tuple[ErrorTracker, ErrorTracker], used: tuple[ErrorTracker, ErrorTracker]) -> dict:
            return {name: {"error": e.percentiles(), "headroom": round(self.factor(u, static), 4)}
                    for name, e, u, static in zip(("ttft", "tpot"), errors, used, (ttft_headroom, tpot_headroom))}
        return {**phases((self.ttft, self.tpot), (self.ttft, self.tpot)),
                "paths": {p: phases(t, self.trackers(p)) for p, t in sorted(self.paths.items())}}


class HandoffTimes:
    """What a REMOTE request's hand-off into each decode worker costs beyond the predicted first
    step: from its prefill's last compute to its first token (the prefill worker's KV send, reported
    in PrefillDone, plus PrefillDone to the first token at the coordinator) less the decode step
    placement predicted, over the last `window` hand-offs (mean, seconds; may be negative: the
    first token leaves with the KV, before any step). Placement adds it to REMOTE's TTFT."""

    def __init__(self, window: int = 64):
        self.window = window
        self.extra: dict[str, collections.deque] = {}

    def record(self, worker: str, observed_s: float, predicted_step_s: float) -> None:
        if math.isfinite(observed_s) and math.isfinite(predicted_step_s) and observed_s >= 0:
            self.extra.setdefault(worker, collections.deque(maxlen=self.window)).append(observed_s - predicted_step_s)

    def extra_s(self, worker: str) -> float:
        xs = self.extra.get(worker)
        return sum(xs) / len(xs) if xs else 0.0

    def forget(self, worker: str) -> None:
        self.extra.pop(worker, None)

    def summary(self) -> dict:
        return {w: {"count": len(xs), "mean_extra_ms": round(1000 * self.extra_s(w), 2)} for w, xs in self.extra.items()}
