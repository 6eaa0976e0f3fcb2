"""`scripts/overload_check`: issue 23's overload check: are the requests pdserve admits served
within both p99 targets in every run of a Poisson overload?

Lifecycle: print the CPU and the load average -> build --runs workloads (random whole-word
prompts of --input-len tokens, greedy, ignore_eos, --output-len tokens, --rate x --duration-s
requests each, Poisson arrivals at --rate req/s; run i has prompts and arrivals of seed
--seed + i) -> for each run: start `pdserve launch --ttft-p99-ms T --tpot-p99-ms P` (default
topology, or `--colocated`; --extra-launch-arg adds flags) through the CLI, wait until it
answers, warm it up with two short requests, send the run, stop it. The server is restarted for
every run, so the runs are independent and each starts with a fresh latency model (the harder
case: the first burst meets an uncalibrated model); `--reuse-server` sends every run to one
server instead (one start, one warm-up, runs in turn). Per run (cells.Cell): offered
(sent), admitted (not shed), shed (HTTP 429), failed (admitted but lost), the admitted and
served requests' p99 TTFT and p99 TPOT, p99 time to a 429, and whether the run is within both
targets: at least one request served, none lost, p99 TTFT <= --ttft-ms and p99 TPOT <= --tpot-ms.
Ends with "within both targets in K of N runs" and issue 23's goal (N of N); `--save-result`
writes it all as JSON. Exit status 0 when every run ran (the goal is printed, not the status).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile

from benchmarks.cells import Cell, format_cells, is_shed, make_cell
from benchmarks.machine import cpu_line, load_line
from benchmarks.servers import Workload, add_server_flags, extra_launch_args, launch_pdserve, report_errors


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/overload_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rate", type=float, default=12.0, help="offered load, req/s (Poisson arrivals)")
    ap.add_argument("--duration-s", type=float, default=20.0, help="requests per run = rate x this")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ttft-ms", type=float, default=3000.0, help="pdserve's --ttft-p99-ms, and the check's")
    ap.add_argument("--tpot-ms", type=float, default=400.0, help="pdserve's --tpot-p99-ms, and the check's")
    ap.add_argument("--colocated", action="store_true", help="launch one colocated worker instead of 1 prefill + 1 decode")
    ap.add_argument("--reuse-server", action="store_true", help="one server for every run (default: a fresh one per run)")
    add_server_flags(ap)
    ap.add_argument("--save-result", default=None, metavar="FILE.json")
    return ap


def within(c: Cell, ttft_ms: float, tpot_ms: float) -> bool:
    """A run holds the targets: something served, no admitted request lost, both p99s within."""
    return c.served > 0 and c.failed == 0 and c.ttft_p99_ms <= ttft_ms and c.tpot_p99_ms <= tpot_ms


def format_runs(cells: list[Cell], ttft_ms: float, tpot_ms: float) -> str:
    lines = format_cells([(f"run {i + 1} ({'within' if within(c, ttft_ms, tpot_ms) else 'OVER'})", c) for i, c in enumerate(cells)])
    k = sum(within(c, ttft_ms, tpot_ms) for c in cells)
    lines += [f"within both targets (TTFT p99 <= {ttft_ms:g} ms, TPOT p99 <= {tpot_ms:g} ms) in {k} of {len(cells)} runs",
              f"goal (issue 23): {'met' if k == len(cells) else 'MISSED'}: admitted requests within both p99 targets in every run"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1 or not 0 < args.rate < float("inf") or not args.duration_s > 0:
        print("scripts/overload_check: --runs must be >= 1, --rate and --duration-s > 0", file=sys.stderr)
        return 2
    from pdserve.bench.workloads import build_requests
    from pdserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    n = max(1, round(args.rate * args.duration_s))
    workloads = [Workload(f"run {i + 1}", build_requests("random", tokenizer, n, args.input_len, args.output_len, 0.0, args.seed + i),
                          None, args.rate, args.seed + i) for i in range(args.runs)]
    flags = [*(["--colocated"] if args.colocated else []), "--ttft-p99-ms", f"{args.ttft_ms:g}", "--tpot-p99-ms", f"{args.tpot_ms:g}",
             *extra_launch_args(args)]
    print(f"cpu: {cpu_line()}")
    load_start = os.getloadavg()
    print(f"{load_line()} at the start")
    print(f"workload: {args.runs} runs of {n} requests, random {args.input_len} in / {args.output_len} out, greedy, ignore_eos, "
          f"Poisson arrivals at {args.rate:g} req/s; server: pdserve launch {' '.join(flags)}, "
          + ("one server for every run, warmed up once" if args.reuse_server else "restarted and warmed up for every run"))
    print(f"reproduce: scripts/overload_check {shlex.join(argv if argv is not None else sys.argv[1:])}".rstrip(), flush=True)
    log_dir = tempfile.mkdtemp(prefix="pdserve-overload-")
    results, startups = {}, []
    batches = [workloads] if args.reuse_server else [[w] for w in workloads]
    for i, batch in enumerate(batches):
        print(f"running {', '.join(w.name for w in batch)} ...", file=sys.stderr, flush=True)
        got, startup = launch_pdserve(args, flags, batch, tokenizer, log_dir, f"server-{i + 1}")
        results.update(got)
        startups.append(startup)
        report_errors("pdserve", got, ignore=is_shed)
    cells = [make_cell(w.rate, *results[w.name], args.ttft_ms, args.tpot_ms) for w in workloads]
    print()
    print(format_runs(cells, args.ttft_ms, args.tpot_ms))
    print("start-up, process start to first answer (s): " + ", ".join(f"{s:.1f}" for s in startups))
    print(f"{load_line()} at the end")
    print(f"(server logs in {log_dir})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"cpu": cpu_line(), "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "args": vars(args), "startup_s": startups,
                       "runs": [{**dataclasses.asdict(c), "admitted": c.admitted, "within": within(c, args.ttft_ms, args.tpot_ms)}
                                for c in cells]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
