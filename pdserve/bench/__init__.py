"""`pdserve bench`: the serving benchmark, modelled on `vllm bench serve` (same flags, same report).

One run: `options` parses the command line (vLLM's flags resolved to pdserve's) -> `workloads`
builds every request up front -> `runner` opens a back-end (`backends`: the pdserve msgspec
client or any OpenAI-compatible HTTP server) and sends the requests on their arrival schedule
-> `metrics` reduces the per-request timings to vLLM's figures -> `report` prints them, writes
the result files and the `--sweep` plot. `overhead` is `--stub-coordinator`: the coordinator
alone under stub workers. `command` strings these together (`pdserve bench` calls its `main`).

matplotlib (the sweep plot) and httpx (the OpenAI back-ends) come with the `bench` extra
(`pip install 'pdserve[bench]'`) and are imported only where used (`import_extra`), so the
engine and the pdserve back-end run without them. Comparisons against other engines and
one-off probes live in the repository's benchmarks/ folder, which is not shipped.
"""
from __future__ import annotations

import importlib


def import_extra(name: str, purpose: str):
    """Import an optional dependency of the `bench` extra, or say how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise RuntimeError(f"{purpose} needs {name}: pip install 'pdserve[bench]'") from None
