"""`scripts/goodput`: issue 23's goodput table: vLLM's CPU build, pdserve's default launch and
pdserve `--colocated`, side by side in one run, each server alone on the machine.

Lifecycle: print the CPU (`lscpu`'s model name and flags) and the load average -> build one
workload per offered rate R in --rates (random whole-word prompts of --input-len tokens, greedy,
ignore_eos, --output-len tokens, --prompts-per-rate x R requests, Poisson arrivals at R req/s),
the same requests for every row -> for each row in turn: start its server, wait until it answers,
warm it up (bench_vs_vllm.run_workloads: two short requests), run the rates one after the
other (each waits for all its requests; the queue is empty when the next begins), stop it. Rows:
- `vllm`: `peers/vllm_cpu.sh serve` (float32), started exactly as scripts/vs_vllm starts it
  (bench_vs_vllm.peer_row);
- `disagg`: `pdserve launch --ttft-p99-ms T --tpot-p99-ms P` (its default topology, 1 prefill +
  1 decode, SLO control on), through the CLI as a user runs it (`launch_pdserve`);
- `colocated`: the same with `--colocated`;
- `auto` (only with --rows): the default launch with `--paths auto`, each request's path chosen.
--extra-launch-arg adds flags to both pdserve rows. Every request goes through the same OpenAI
streaming client (`/v1/completions`). Per (row, rate) a `Cell`: requests sent, served, shed
(HTTP 429: refused by admission control), failed otherwise, goodput (served requests/s within
TTFT <= --ttft-ms and TPOT <= --tpot-ms, as `pdserve bench --goodput` counts it), p99 TTFT and
p99 TPOT of the served ones, p99 time to a 429. Prints the goodput table with the ratios
default/colocated and default/vLLM, the per-cell details and issue 23's goal checks (default >=
colocated and >= vLLM at each rate); `--save-result` writes it all as JSON. Exit status 0
when every row ran (whether the goals are met is printed, not the exit status).
`launch_pdserve`, `Cell`, `cpu_line` and `format_cells` are shared with scripts/overload_check.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from pdserve import bench_vs_vllm as vs

ROWS = ("vllm", "disagg", "colocated")  # the rows of a run without --rows
ALL_ROWS = ("vllm", "disagg", "auto", "colocated")  # auto: the default launch with each request's path chosen (--paths auto)
ROW_NAMES = {"vllm": vs.ROW_NAMES["vllm"], "disagg": "pdserve default 1P+1D", "auto": "pdserve 1P+1D paths auto",
             "colocated": "pdserve --colocated"}
ROW_LAUNCH = {"disagg": [], "auto": ["--paths", "auto"], "colocated": ["--colocated"]}  # `pdserve launch` flags besides the targets


@dataclasses.dataclass
class Cell:
    """One timed run of one server: what came of its requests."""

    rate: float  # offered load, req/s
    sent: int
    served: int
    shed: int  # HTTP 429: refused by admission control
    failed: int  # any other error: an admitted request lost ("lost")
    duration: float  # seconds, first send to last answer
    goodput: float  # served req/s within both targets
    ttft_p99_ms: float | None  # of the served requests; None when none was served
    tpot_p99_ms: float | None
    shed_p99_ms: float | None  # send to the 429; None when none was shed

    @property
    def admitted(self) -> int:
        return self.sent - self.shed


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
    ap.add_argument("--save-result", default=None, metavar="FILE.json")
    return ap


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    """Flags both scripts share: the model, more `pdserve launch` flags, vLLM's peers dir, the seed."""
    ap.add_argument("--model", default=None, help="pdserve's model (default: SmolLM2-135M-Instruct GGUF); vLLM serves its HF copy")
    ap.add_argument("--extra-launch-arg", action="append", default=[], metavar="FLAGS",
                    help="more `pdserve launch` flags for the pdserve rows, split like a shell, repeatable: "
                         "--extra-launch-arg='--max-num-seqs 64'")
    ap.add_argument("--peers", default=str(vs.REPO.parent / "shared" / "peers"), help="directory holding vllm_cpu.sh")
    ap.add_argument("--seed", type=int, default=0)


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


def extra_launch_args(args) -> list[str]:
    return [a for text in args.extra_launch_arg for a in shlex.split(text)]


# ------------------------------------------------------------------ the machine

def cpu_line() -> str:
    """`lscpu`'s model name and flags (from /proc/cpuinfo without lscpu)."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.SubprocessError):
        pass
    if "model name" not in fields or "flags" not in fields:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    fields.setdefault(k.strip().lower(), v.strip())
        except OSError:
            pass
    return f"Model name: {fields.get('model name', 'unknown')}; Flags: {fields.get('flags', 'unknown')}"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} cores)"


# ------------------------------------------------------------------ one server

def launch_command(args, launch_flags: list[str], log_dir: str, http_port: int) -> list[str]:
    """`pdserve launch` as a user runs it, on free loopback ports, its roles' logs in log_dir."""
    from pdserve.bench_overhead import free_port

    return [sys.executable, "-m", "pdserve", "launch", "--http-port", str(http_port),
            "--clients", f"tcp://127.0.0.1:{free_port()}", "--workers", f"tcp://127.0.0.1:{free_port()}", "--log-dir", log_dir,
            *(["--model", args.model] if args.model else []), *launch_flags]


def launch_pdserve(args, launch_flags: list[str], workloads, tokenizer, log_dir: str, name: str) -> tuple[dict, float]:
    """Start `pdserve launch LAUNCH_FLAGS` (the launcher's own output in LOG_DIR/NAME.log, its roles'
    in LOG_DIR/NAME/), wait until its gateway's /health answers (a worker pair registered), run the
    workloads (bench_vs_vllm.run_workloads: warm-up, then each in turn), stop it (SIGTERM to the
    launcher, which stops its roles). Returns ({workload name: (outputs, seconds)}, start-up seconds)."""
    from pdserve.bench_compare import wait_http
    from pdserve.bench_overhead import free_port

    port = free_port()
    cmd = launch_command(args, launch_flags, os.path.join(log_dir, name), port)
    log = open(os.path.join(log_dir, f"{name}.log"), "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=vs.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, 600)
        startup = time.perf_counter() - t0
        return vs.run_workloads(url, workloads, tokenizer), startup
    finally:
        vs.stop_group(proc, leader_only=True)
        log.close()


def pdserve_flags(args, row: str) -> list[str]:
    """The `pdserve launch` flags of a pdserve row (after the ports, the log dir and --model)."""
    return [*ROW_LAUNCH[row], "--ttft-p99-ms", f"{args.ttft_ms:g}", "--tpot-p99-ms", f"{args.tpot_ms:g}", *extra_launch_args(args)]


# ------------------------------------------------------------------ figures

def is_shed(o) -> bool:
    return not o.success and o.error.startswith("HTTP 429")


def make_cell(rate: float, outputs, duration: float, ttft_ms: float, tpot_ms: float) -> Cell:
    from pdserve.bench_metrics import compute_metrics, summarize

    m = compute_metrics(outputs, duration, {"ttft": ttft_ms, "tpot": tpot_ms}, metrics=("ttft", "tpot"), percentiles=(99,))
    shed = [o.latency for o in outputs if is_shed(o)]
    served = m.completed
    return Cell(rate, len(outputs), served, len(shed), m.failed - len(shed), duration, m.request_goodput or 0.0,
                m.latency_ms["ttft"]["p99"] if served else None, m.latency_ms["tpot"]["p99"] if served else None,
                summarize(shed, (99,))["p99"] if shed else None)


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def ratio(a: float, b: float) -> str:
    if b > 0:
        return f"{a / b:.2f}x"
    return "inf" if a > 0 else "-"


def format_cells(cells: list[tuple[str, Cell]]) -> list[str]:
    """One line per cell: label, offered load (req/s), requests offered (sent), admitted (not shed),
    served, shed, lost (admitted, then failed), goodput, p99s."""
    head = (f"{'':24s} {'req/s':>6s} {'offered':>7s} {'admitted':>8s} {'served':>6s} {'shed':>5s} {'lost':>4s} {'goodput':>7s} "
            f"{'TTFT p99':>8s} {'TPOT p99':>8s} {'429 p99':>7s}")
    lines = [head, "-" * len(head)]
    for label, c in cells:
        lines.append(f"{label:24s} {c.rate:6g} {c.sent:7d} {c.admitted:8d} {c.served:6d} {c.shed:5d} {c.failed:4d} {c.goodput:7.2f} "
                     f"{ms(c.ttft_p99_ms):>8s} {ms(c.tpot_p99_ms):>8s} {ms(c.shed_p99_ms):>7s}")
    lines.append("(goodput: served req/s within both targets; TTFT/TPOT: ms, p99 of the served requests; "
                 "429 p99: ms to a refusal)")
    return lines


def goal_checks(table: dict[str, list[Cell]]) -> list[tuple[str, bool]]:
    """Issue 23: the default launch's goodput >= colocated's and >= vLLM's at each rate
    (only for the rows measured)."""
    checks = []
    for i, mine in enumerate(table.get("disagg", [])):
        for other in ("colocated", "vllm"):
            if other in table:
                theirs = table[other][i]
                ok = mine.goodput >= theirs.goodput
                checks.append((f"default >= {ROW_NAMES[other]} at {mine.rate:g} req/s: {mine.goodput:.2f} vs "
                               f"{theirs.goodput:.2f} ({ratio(mine.goodput, theirs.goodput)})", ok))
    return checks


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
    from pdserve.bench_data import build_requests
    from runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workloads = [vs.Workload(f"{rate:g} req/s", build_requests("random", tokenizer, max(1, round(args.prompts_per_rate * rate)),
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
    table, startups = {}, {}
    for row in rows:
        print(f"running {ROW_NAMES[row]} ...", file=sys.stderr, flush=True)
        if row in vs.PEERS:
            results, startups[row] = vs.peer_row(args, row, workloads, tokenizer, log_dir)
        else:
            results, startups[row] = launch_pdserve(args, pdserve_flags(args, row), workloads, tokenizer, log_dir, row)
        table[row] = [make_cell(w.rate, *results[w.name], args.ttft_ms, args.tpot_ms) for w in workloads]
        report_errors(ROW_NAMES[row], results)
    print()
    print(format_table(table))
    print("start-up, process start to first answer (s): " + ", ".join(f"{ROW_NAMES[r]} {s:.1f}" for r, s in startups.items()))
    print(f"{load_line()} at the end")
    print(f"(server logs in {log_dir})")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"cpu": cpu_line(), "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "args": vars(args), "startup_s": startups,
                       "rows": {row: [dataclasses.asdict(c) for c in cells] for row, cells in table.items()},
                       "goals": [{"check": text, "met": ok} for text, ok in goal_checks(table)]}, f, indent=1)
    return 0


def report_errors(name: str, results: dict) -> None:
    """Errors other than 429s, one line per kind, on stderr."""
    for workload, (outs, _) in results.items():
        errors = sorted({o.error for o in outs if not o.success and not is_shed(o)})
        if errors:
            print(f"{name} / {workload}: {len(errors)} kind(s) of error, first: {errors[0][:200]}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
