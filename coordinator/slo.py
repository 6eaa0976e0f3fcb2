"""The coordinator's latency models and SLO records.

Lifecycle: each worker's `StepModel` is seeded from the start-up profile in its Hello and then
refitted online from the step samples in every heartbeat (non-negative least squares of the
relative error over a sliding window:
seconds ~ a + b*seqs + c*tokens + d*context_tokens). Placement (coordinator/placement.py)
predicts TTFT and TPOT from these models for each new request and places or sheds it. Served
requests feed `LatencyWindow`s (p50/p90/p99 per priority class, in `SloRecorder`) and the
prediction-error record; shed requests are counted there too.
"""
from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("pdserve.slo")

RELAY_OVERHEAD_S = 0.003  # coordinator + socket hops around a prefill, measured on loopback


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float
    tpot_s: float


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| over c >= 0, exactly, for a few columns: the NNLS optimum is the plain
    least-squares fit on the columns it leaves positive, so the best of the fits on every subset
    of columns whose coefficients all come out non-negative is it (15 subsets of 4 columns).
    Why non-negative: a step never costs less for one more sequence, token or context token, and
    an unconstrained fit over collinear samples trades a negative cost per sequence against a huge
    one per context token (measured: -67 ms a sequence, +1 ms a context token after one slow
    step), which predicts nothing outside the samples' own shapes."""
    gram, xy, n = x.T @ x, x.T @ y, x.shape[1]
    best, best_err = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in map(list, itertools.combinations(range(n), k)):
            g = gram[np.ix_(cols, cols)]
            # a small ridge keeps collinear columns (decode: seqs == tokens) well posed
            c = np.linalg.solve(g + 1e-6 * np.eye(k), xy[cols])
            if (c < 0).any():
                continue
            err = float(y @ y - 2 * c @ xy[cols] + c @ g @ c)  # |x_cols c - y|^2
            if err < best_err:
                best, best_err = np.zeros(n), err
                best[cols] = c
    return best


class StepModel:
    """seconds of one step ~ a + b*seqs + c*tokens + d*context, fitted on sliding windows with
    every coefficient >= 0 (nonnegative_least_squares), each step by its relative error.

    Prompt-shaped steps (more tokens than sequences: prefill chunks) and decode-shaped ones (one
    token a sequence) keep windows of their own, both always in the fit: on a decode worker the
    decode steps would otherwise push every prompt sample out, tokens would equal sequences in
    every sample, and the per-token cost (what a prefill placed on it costs) could not be told
    from the per-sequence cost (measured: a 512-token prompt predicted 1.01 s against 0.53 s
    after 300 decode steps). A backlog drains at the prompt steps' token rate."""

    def __init__(self, samples=(), window: int = 256):
        self.decode_steps: collections.deque = collections.deque(maxlen=window)
        self.prompt_steps: collections.deque = collections.deque(maxlen=window)
        self.coef: np.ndarray | None = None
        self.add(samples)

    @property
    def samples(self) -> list:
        return [*self.prompt_steps, *self.decode_steps]

    def add(self, samples) -> None:
        for s in samples:
            (self.prompt_steps if s[1] > s[0] else self.decode_steps).append(tuple(s))
        if samples:
            self.coef = None

    def _fit(self) -> np.ndarray:
        if self.coef is None:
            data = np.array(self.samples, dtype=np.float64)
            # relative error: each step weighs 1 / its time, so the few long prompt steps do not
            # decide the fit of the many short decode steps (unweighted, a start-up profile's fit
            # predicted decode steps at 2.8-4.6x their time, median, and admission shed for it)
            scale = 1.0 / np.maximum(data[:, 3], 1e-6)
            x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2] / 1000.0]) * scale[:, None]
            self.coef = nonnegative_least_squares(x, data[:, 3] * scale)
        return self.coef

    def tokens_per_second(self) -> float:
        """Throughput of its prompt steps (all steps while it has none): what a backlog of queued
        prompt tokens drains at."""
        steps = self.prompt_steps or self.decode_steps
        seconds = sum(s[3] for s in steps)
        return sum(s[1] for s in steps) / seconds if seconds > 0 else float("inf")

    def predict(self, seqs: int, tokens: int, context: int) -> float:
        if not (self.prompt_steps or self.decode_steps):
            return 0.0
        c = self._fit()
        t = c[0] + c[1] * seqs + c[2] * tokens + c[3] * context / 1000.0
        return max(float(t), min(s[3] for s in self.samples))


class CoreShareSlowdown:
    """How much longer a worker's steps take on a share of its node's cores than on all of them.

    A worker on a core share (runtime/cores.py) runs on cores // (busy workers) threads; its
    heartbeat reports such steps apart (Heartbeat.shared_steps, with their threads), its all-core
    model (`StepModel`) is fitted on the others. Each shared step is held against that model's
    prediction scaled linearly by all / threads; the ratio of their sums over a window (time-
    weighted: the long steps are those that decide TTFT and TPOT) says how far from linear this
    worker scales, and `factor` = (all / threads) x that ratio. Until MIN_STEPS shared steps were
    seen, the linear factor. Why not linear alone: measured on 2 cores (Zen 4, SmolLM2-135M), one
    thread per worker ran a 16-sequence decode step in 55 ms against 36.6 ms on both threads
    (1.5x, not 2x), 128-token prompts at 1.77x: the linear factor over-predicts a shared step by
    up to a third, and admission sheds what the node could serve."""

    MIN_STEPS = 16

    def __init__(self, window: int = 128):
        self.steps: collections.deque = collections.deque(maxlen=window)  # (seconds, linear prediction)

    def add(self, samples, model: StepModel, all_threads: int) -> None:
        for seqs, tokens, context, seconds, threads in samples:
            predicted = model.predict(seqs, tokens, context)
            if predicted > 0 and 0 < threads < all_threads:
                self.steps.append((seconds, predicted * all_threads / threads))

    def ratio(self) -> float:
        """Shared steps' time over their linear prediction (1.0 until MIN_STEPS were seen)."""
        if len(self.steps) < self.MIN_STEPS:
            return 1.0
        predicted = sum(p for _, p in self.steps)
        return sum(s for s, _ in self.steps) / predicted if predicted > 0 else 1.0

    def factor(self, all_threads: int, threads: int) -> float:
        """A step on `threads` of its `all_threads`: its all-core time times this (>= 1, at most
        1.5x linear: a few steps slowed by something else must not shut the worker)."""
        linear = all_threads / max(1, threads)
        return max(1.0, linear * min(self.ratio(), 1.5))


class StretchedModel:
    """A worker's step model with every step `factor` times as long (a share of its node's cores)."""

    def __init__(self, model: StepModel, factor: float):
        self.model, self.factor = model, factor

    def predict(self, seqs: int, tokens: int, context: int) -> float:
        return self.factor * self.model.predict(seqs, tokens, context)

    def tokens_per_second(self) -> float:
        return self.model.tokens_per_second() / self.factor


class LatencyWindow:
    """The last `size` values of one latency, with percentiles."""

    def __init__(self, size: int = 2000):
        self.values: collections.deque = collections.deque(maxlen=size)

    def add(self, v: float) -> None:
        self.values.append(v)

    def percentiles(self) -> dict:
        if not self.values:
            return {"count": 0}
        a = np.fromiter(self.values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"count": len(a), "p50": p50, "p90": p90, "p99": p99}


MAX_CLASSES = 16  # priority classes with their own windows; further ones share OTHER_CLASS
OTHER_CLASS = "other"


class SloRecorder:
    """Per priority class TTFT/TPOT windows and predicted-vs-actual TTFT. Priority is any int a
    client sends, so the number of classes kept apart is bounded: the first MAX_CLASSES seen
    get their own windows and shed counts, later ones are pooled under OTHER_CLASS."""

    def __init__(self):
        self.ttft: dict[int | str, LatencyWindow] = collections.defaultdict(LatencyWindow)
        self.tpot: dict[int | str, LatencyWindow] = collections.defaultdict(LatencyWindow)
        self.ttft_error = LatencyWindow()  # |predicted - actual| / actual
        self.shed = collections.Counter()
        self.classes: set[int] = set()

    def class_of(self, priority: int) -> int | str:
        if priority in self.classes:
            return priority
        if len(self.classes) < MAX_CLASSES:
            self.classes.add(priority)
            return priority
        return OTHER_CLASS

    def record_shed(self, priority: int) -> None:
        self.shed[self.class_of(priority)] += 1

    def record(self, priority: int, ttft: float, tpot: float | None, predicted_ttft: float | None) -> None:
        c = self.class_of(priority)
        self.ttft[c].add(ttft)
        if tpot is not None:
            self.tpot[c].add(tpot)
        if predicted_ttft is not None and ttft > 0:
            self.ttft_error.add(abs(predicted_ttft - ttft) / ttft)

    def summary(self) -> dict:
        classes = sorted(set(self.ttft) | set(self.tpot), key=str)
        return {
            "classes": {str(c): {"ttft": self.ttft[c].percentiles(), "tpot": self.tpot[c].percentiles()} for c in classes},
            "ttft_prediction_error": self.ttft_error.percentiles(),
            "shed": {str(c): n for c, n in self.shed.items()},
        }
