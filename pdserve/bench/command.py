"""`pdserve bench`: the command, from its argument list to its exit status.

Lifecycle of one run: parse and resolve the flags (`options`) -> `--stub-coordinator`: measure
the coordinator alone (`overhead`) and stop; else load the tokenizer and build every request up
front (`workloads`) -> freeze the start-up heap (no full-collection pause inside the measured
latencies) -> send them at each rate (`runner`: one rate, or each of `--sweep R1,R2,...`) ->
print the figures, write the result files and the sweep plot (`report`). Exit status 0 when any
request succeeded, 1 when none did, 2 on a bad flag or an unreachable server.
"""
from __future__ import annotations

import asyncio
import sys

from pdserve.bench import import_extra
from pdserve.bench.options import build_parser, parse_rates, resolve


def load_bench_tokenizer(args):
    from pathlib import Path

    from pdserve.common.tokenizer import load_tokenizer

    path = args.tokenizer or (args.model if args.model and Path(args.model).exists() else None)
    return load_tokenizer(path), path or "default"


def run(args) -> int:
    resolve(args)
    if args.stub_coordinator:
        from pdserve.bench.overhead import run_overhead

        return run_overhead(args)
    from pdserve.bench.report import plot_sweep, print_runs, save_results
    from pdserve.bench.runner import run_rates
    from pdserve.bench.workloads import build_workload
    from pdserve.common.heap import freeze_startup_heap

    rates = parse_rates(args.sweep) if args.sweep else [args.request_rate]
    if args.sweep:
        import_extra("matplotlib", "--sweep's plot")  # before the run, not after it
    tokenizer, tokenizer_id = load_bench_tokenizer(args)
    requests = build_workload(args, tokenizer)
    freeze_startup_heap()  # no full-collection pause inside the measured latencies
    runs = asyncio.run(run_rates(args, requests, tokenizer, rates))
    results = print_runs(args, runs, tokenizer_id)
    if args.sweep:
        plot_sweep(results, args.plot)
        print(f"sweep plot written to {args.plot}")
    save_results(args, results, tokenizer_id)
    return 0 if any(o.success for _, outs, _ in runs for o in outs) else 1


def main(argv: list[str] | None = None) -> int:
    from pdserve_client.errors import PdserveError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, ConnectionError, RuntimeError, PdserveError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
