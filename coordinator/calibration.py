"""How wrong the latency predictions are, and the admission headroom that follows from it.
Plain classes, no sockets and no clock.

Lifecycle: when a request ends the coordinator `record`s its predicted TTFT and TPOT (from its
placement Decision) next to the observed ones. Each phase keeps the last `window` relative errors
e = (observed - predicted) / predicted (positive: the model under-predicted). Before each
placement it asks `targets(base, ttft_headroom, tpot_headroom)` for what a prediction must meet:
with fewer than `min_samples` errors the static headroom (CoordinatorConfig.ttft_headroom /
tpot_headroom), then, per phase, target / (1 + k * q) with q the `quantile` of the
under-predictions, clamped to [floor, 1]. Why: observed = predicted * (1 + e), so a request
admitted at predicted <= target / (1 + q) is within target unless its error is beyond the
quantile. Under overload admission fills up to the limit, so the admitted requests' predictions
crowd at it: for p99 targets the quantile is the 99th. `summary` exports the error percentiles
and the headroom in use (stats, /metrics).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from coordinator.slo import SloTargets


@dataclass(frozen=True)
class CalibrationConfig:
    window: int = 256  # errors kept per phase (as many as a StepModel keeps steps)
    min_samples: int = 50  # fewer: the static headroom (a 99th percentile of fewer says little)
    quantile: float = 99.0  # of the under-predictions: p99 targets
    k: float = 1.0  # headroom per unit of that error
    floor: float = 0.5  # never admit against less than half the target: past that the model is what to fix


class ErrorTracker:
    """The last `window` relative errors of one prediction."""

    def __init__(self, window: int):
        self.errors: collections.deque = collections.deque(maxlen=window)

    def add(self, predicted: float | None, observed: float | None) -> None:
        if predicted is None or observed is None or not (predicted > 0 and math.isfinite(predicted) and math.isfinite(observed)):
            return
        self.errors.append((observed - predicted) / predicted)

    def under(self, quantile: float) -> float:
        """The quantile of the errors, 0 when the model over-predicts there."""
        return max(0.0, float(np.percentile(np.fromiter(self.errors, dtype=np.float64), quantile)))

    def percentiles(self) -> dict:
        if not self.errors:
            return {"count": 0}
        p50, p90, p99 = np.percentile(np.fromiter(self.errors, dtype=np.float64), [50, 90, 99])
        return {"count": len(self.errors), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


class Calibration:
    def __init__(self, cfg: CalibrationConfig = CalibrationConfig()):
        self.cfg = cfg
        self.ttft = ErrorTracker(cfg.window)
        self.tpot = ErrorTracker(cfg.window)

    def record(self, predicted_ttft: float | None, ttft: float, predicted_tpot: float | None, tpot: float | None) -> None:
        self.ttft.add(predicted_ttft, ttft)
        self.tpot.add(predicted_tpot, tpot)

    def factor(self, tracker: ErrorTracker, static: float) -> float:
        """The share of a target a prediction must meet: static until min_samples errors."""
        if len(tracker.errors) < self.cfg.min_samples:
            return static
        return min(1.0, max(self.cfg.floor, 1.0 / (1.0 + self.cfg.k * tracker.under(self.cfg.quantile))))

    def targets(self, base: SloTargets, ttft_headroom: float, tpot_headroom: float) -> SloTargets:
        """base less the headroom: what a request's predictions must meet to be admitted."""
        return SloTargets(base.ttft_s * self.factor(self.ttft, ttft_headroom), base.tpot_s * self.factor(self.tpot, tpot_headroom))

    def summary(self, ttft_headroom: float, tpot_headroom: float) -> dict:
        """Per phase: the relative error percentiles (signed; positive under-predicts) and the headroom in use."""
        return {name: {"error": t.percentiles(), "headroom": round(self.factor(t, static), 4)}
                for name, t, static in (("ttft", self.ttft, ttft_headroom), ("tpot", self.tpot, tpot_headroom))}
