"""Timing a callable the same way in every probe: `median_seconds(fn, repeats, warmup)` calls it
`warmup` times untimed (first calls allocate, compile, fault pages in), then `repeats` times
timed with `time.perf_counter`, and returns the median in seconds.
"""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int, warmup: int = 0) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
