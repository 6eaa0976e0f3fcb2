"""`scripts/goodput`: issue 23's goodput table: vLLM's CPU build, pdserve's default launch and
pdserve `--colocated`, side by side in one run, each server alone on the machine.

Lifecycle: print the CPU (`lscpu`'s model name and flags) and the load average -> build one
workload per offered rate R in --rates (random whole-word prompts of --input-len tokens, greedy,
ignore_eos, --output-len tokens, --prompts-per-rate x R requests, Poisson arrivals at R req/s),
the same requests for every row -> for each row in turn: start its server, wait until it answers,
warm it up (servers.run_workloads: two short requests), run the rates one after the
other (each waits for all its requests; the queue is empty when the next begins), stop it. Rows:
- `vllm`: `peers/vllm_cpu.sh serve` (float32), started exactly as scripts/vs_vllm starts it
  (servers.peer_row);
- `disagg`: `pdserve launch --ttft-p99-ms T --tpot-p99-ms P` (its default topology, 1 prefill +
  1 decode, SLO control on), through the CLI as a user runs it (`servers.launch_pdserve`);
- `colocated`: the same with `--colocated`;
- `remote`, `auto` (only with --rows): the default launch with `--paths remote` (every prompt on the
  prefill worker, the default before 2026-12-02) or `--paths auto` (the default, spelled out);
  `planner`: the default launch with `--planner` (roles follow the load: on one node it moves the
  idle prefill worker to decode under overload); `two-decode`: two decode workers and no prefill
  worker (each prefills locally, the node's cores shared by who is busy: one thread each when both
  are); `two-static`: the same with `--threads 1` (no core share: one thread each always).
--extra-launch-arg adds flags to both pdserve rows. `--repeat N` runs the pdserve rows N times,
interleaved (every other round in reverse order, so a drift of the machine favours neither), a
peer row once; the table then holds each (row, rate)'s median run by goodput (the lower middle
one for even N) and each round's goodput and ratios are printed after it. Every request goes through the same OpenAI
streaming client (`/v1/completions`). Per (row, rate) a `cells.Cell`: requests sent, served, shed
(HTTP 429: refused by admission control), failed otherwise, goodput (served requests/s within
TTFT <= --ttft-ms and TPOT <= --tpot-ms, as `pdserve bench --goodput` counts it), p99 TTFT and
p99 TPOT of the served ones, p99 time to a 429. Prints the goodput table with the ratios
default/colocated and default/vLLM, the per-cell details and issue 23's goal checks (default >=
colocated and >= vLLM at each rate; a default run that served every request sent within both
targets meets them whatever the other's figure: goal_checks); `--save-result` writes it all as JSON. Exit status 0
when every row ran (whether the goals are met is printed, not the exit status).
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
from benchmarks.servers import PEERS, Workload, add_server_flags, extra_launch_args, launch_pdserve, peer_row, report_errors

ROWS = ("vllm", "disagg", "colocated")  # the rows of a run without --rows
ALL_ROWS = ("vllm", "disagg", "remote", "auto", "planner", "two-decode", "two-static", "colocated")  # all but vllm/disagg/colocated: with --rows
ROW_NAMES = {"vllm": PEERS["vllm"].name, "disagg": "pdserve default 1P+1D", "remote": "pdserve 1P+1D paths remote",
             "auto": "pdserve 1P+1D paths auto", "planner": "pdserve 1P+1D --planner", "two-decode": "pdserve 0P+2D",
             "two-static": "pdserve 0P+2D --threads 1", "colocated": "pdserve --colocated"}
ROW_LAUNCH = {"disagg": [], "remote": ["--paths", "remote"], "auto": ["--paths", "auto"], "planner": ["--planner"],
              "two-decode": ["--prefill", "0", "--decode", "2"], "two-static": ["--prefill", "0", "--decode", "2", "--threads", "1"],
              "colocated": ["--colocated"]}  # `pdserve launch` flags besides the targets


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/goodput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ALL_ROWS)}")
    ap.add_argument("--rates", default="4,8,16", help="offered loads, req/s (Poisson arrivals)")
    ap.add_argument("--prompts-per-rate", type=float, default=30.0, help="requests per run = this x the rate")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT target: goodput's, and pdserve's --ttft-p99-ms")
    ap.add_argument("--tpot-ms", type=float, default=250.0, help="TPOT target: goodput's, and pdserve's --tpot-p99-ms")
    add_server_flags(ap)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the pdserve rows (peer rows run once); the table shows medians")
    ap.add_argument("--save-result", default=None, metavar="FILE.json")
    return ap


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates takes positive finite rates separated by commas, got {text!r}")
    return rates


def parse_rows(text: str, known=ALL_ROWS) -> list[str]:
    rows = [r for r in text.split(",") if r]
    bad = [r for r in rows if r not in known]
    if bad or not rows:
        raise ValueError(f"unknown row {', '.join(bad) or '(none given)'} (rows: {', '.join(known)})")
    return rows


# ------------------------------------------------------------------ the pdserve rows

def pdserve_flags(args, row: str) -> list[str]:
    """The `pdserve launch` flags of a pdserve row (after the ports, the log dir and --model)."""
    return [*ROW_LAUNCH[row], "--ttft-p99-ms", f"{args.ttft_ms:g}", "--tpot-p99-ms", f"{args.tpot_ms:g}", *extra_launch_args(args)]


# ------------------------------------------------------------------ figures

def ratio(a: float, b: float) -> str:
    if b > 0:
        return f"{a / b:.2f}x"
    return "inf" if a > 0 else "-"


def goal_checks(table: dict[str, list[Cell]]) -> list[tuple[str, bool]]:
    """Issue 23: the default launch's goodput >= colocated's and >= vLLM's at each rate
    (only for the rows measured). A run that served every request it was sent within both
    targets has all the goodput its workload holds: it meets the goal whatever the other's
    figure (goodput divides by the time to the last answer, so two such runs differ by a
    few ms of the last request's tail, not by what they served)."""
    checks = []
    for i, mine in enumerate(table.get("disagg", [])):
        for other in ("colocated", "vllm"):
            if other in table:
                theirs = table[other][i]
                everyone = mine.on_time == mine.sent
                ok = mine.goodput >= theirs.goodput or everyone
                checks.append((f"default >= {ROW_NAMES[other]} at {mine.rate:g} req/s: {mine.goodput:.2f} vs "
                               f"{theirs.goodput:.2f} ({ratio(mine.goodput, theirs.goodput)})"
                               + (f", default served all {mine.sent} on time" if everyone else ""), ok))
    return checks


def median_cells(rounds: list[list[Cell]]) -> list[Cell]:
    """Per rate, the run of median goodput over the rounds (the lower middle one for an even count)."""
    return [sorted(cells, key=lambda c: c.goodput)[(len(cells) - 1) // 2] for cells in zip(*rounds)]


def format_rounds(runs: dict[str, list[list[Cell]]]) -> str:
    """Each round's goodput per row and, where both ran in it, default / colocated."""
    lines = ["goodput of each round (req/s, rates as above):"]
    for row in ALL_ROWS:
        for k, cells in enumerate(runs.get(row, [])):
            lines.append(f"  {ROW_NAMES[row]:24s} round {k + 1}: " + " ".join(f"{c.goodput:6.2f}" for c in cells))
    for k, (mine, theirs) in enumerate(zip(runs.get("disagg", []), runs.get("colocated", []))):
        lines.append(f"  {'default / colocated':24s} round {k + 1}: " + " ".join(f"{ratio(a.goodput, b.goodput):>6s}" for a, b in zip(mine, theirs)))
    return "\n".join(lines)


def format_table(table: dict[str, list[Cell]]) -> str:
    """The goodput table (rows x rates), the ratios, the per-cell details and the goal checks."""
    rates = next(iter(table.values()))
    head = f"{'goodput (req/s)':24s}" + "".join(f"{f'{c.rate:g} req/s':>11s}" for c in rates)
    lines = [head, "-" * len(head)]
    for row in ALL_ROWS:
        if row in table:
            lines.append(f"{ROW_NAMES[row]:24s}" + "".join(f"{c.goodput:11.2f}" for c in table[row]))
    for other, label in (("colocated", "default / colocated"), ("vllm", "default / vLLM")):
        if "disagg" in table and other in table:
            lines.append(f"{label:24s}" + "".join(f"{ratio(a.goodput, b.goodput):>11s}" for a, b in zip(table["disagg"], table[other])))
    lines += ["", *format_cells([(ROW_NAMES[row], c) for row in ALL_ROWS if row in table for c in table[row]])]
    checks = goal_checks(table)
    if checks:
        lines += ["", "goals (issue 23):"] + [f"  {'met   ' if ok else 'MISSED'} {text}" for text, ok in checks]
        lines.append(f"goals met: {sum(ok for _, ok in checks)} of {len(checks)}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the command

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows, rates = parse_rows(args.rows), parse_rates(args.rates)
    except ValueError as e:
        print(f"scripts/goodput: {e}", file=sys.stderr)
        return 2
    from pdserve.bench.workloads import build_requests
    from pdserve.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workloads = [Workload(f"{rate:g} req/s", build_requests("random", tokenizer, max(1, round(args.prompts_per_rate * rate)),
                                                             args.input_len, args.output_len, 0.0, args.seed + i), None, rate,
                          args.seed + i) for i, rate in enumerate(rates)]
    print(f"cpu: {cpu_line()}")
    load_start = os.getloadavg()
    print(f"{load_line()} at the start")
    print(f"workload: random {args.input_len} in / {args.output_len} out, greedy, ignore_eos, Poisson arrivals at each rate, "
          f"{args.prompts_per_rate:g} x rate requests; goodput: served requests within TTFT <= {args.ttft_ms:g} ms and TPOT <= "
          f"{args.tpot_ms:g} ms; client: OpenAI /v1/completions streaming; one server at a time, rates in turn after a warm-up")
    for row in rows:
        if row in ROW_LAUNCH:
            print(f"{ROW_NAMES[row]}: pdserve launch {' '.join(pdserve_flags(args, row))}")
    print(f"reproduce: scripts/goodput {shlex.join(argv if argv is not None else sys.argv[1:])}".rstrip(), flush=True)
    log_dir = tempfile.mkdtemp(prefix="pdserve-goodput-")
    runs: dict[str, list[list[Cell]]] = {}
    startups = {}
    for k in range(max(1, args.repeat)):
        for row in (rows if k % 2 == 0 else rows[::-1]):
            if row in PEERS and k:
                continue
            print(f"running {ROW_NAMES[row]} (round {k + 1}) ...", file=sys.stderr, flush=True)
            name = row if k == 0 else f"{row}-{k + 1}"  # its log directory
            if row in PEERS:
                results, startup = peer_row(args, row, workloads, tokenizer, log_dir)
            else:
                results, startup = launch_pdserve(args, pdserve_flags(args, row), workloads, tokenizer, log_dir, name)
            startups.setdefault(row, startup)
            runs.setdefault(row, []).append([make_cell(w.rate, *results[w.name], args.ttft_ms, args.tpot_ms) for w in workloads])
            report_errors(ROW_NAMES[row], results, ignore=is_shed)  # a 429 is a shed request, counted in the table
    table = {row: median_cells(runs[row]) for row in rows}
    print()
    if args.repeat > 1:
        print(f"medians of {args.repeat} rounds of the pdserve rows (peer rows: one run)")
    print(format_table(table))
    if args.repeat > 1:
        print(format_rounds(runs))
    print("start-up, process start to first answer (s): " + ", ".join(f"{ROW_NAMES[r]} {s:.1f}" for r, s in startups.items()))
    print(f"{load_line()} at the end")
    print(f"(server logs in {log_dir})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"cpu": cpu_line(), "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "args": vars(args), "startup_s": startups,
                       "rows": {row: [dataclasses.asdict(c) for c in cells] for row, cells in table.items()},
                       "rounds": {row: [[dataclasses.asdict(c) for c in cells] for cells in rounds] for row, rounds in runs.items()},
                       "goals": [{"check": text, "met": ok} for text, ok in goal_checks(table)]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
