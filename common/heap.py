"""Garbage-collector set-up for long-running server processes.

Lifecycle: each process that serves (coordinator, gateway, prefill, decode and colocated
workers, and the benchmark's load generator) calls `freeze_startup_heap()` once, after it has
imported and loaded everything it keeps for its lifetime (torch, transformers, the model, the
tokenizer) and before it takes traffic. Nothing else here runs later.

Why: those imports leave about 200,000 long-lived objects on the heap, and a full collection
walks all of them (tens of milliseconds: docs/performance.md, "Figures behind design choices").
Such a pause inside the coordinator delays every admission, rejection and token relay behind
it. `gc.freeze()` moves them to a permanent generation that
collections skip; a full collection then costs microseconds. vLLM does the same after start-up.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()
