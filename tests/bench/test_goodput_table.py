"""scripts/goodput's table and goal checks and scripts/overload_check's summary, from fabricated
request outputs (no processes), their command lines (checked before anything starts), and one
overload run end to end through `pdserve launch` against the tiny model."""
import json

import pytest

from benchmarks import goodput as gp
from benchmarks import overload_check as ov
from benchmarks.cells import Cell, format_cells, make_cell
from benchmarks.machine import cpu_line
from benchmarks.servers import launch_command
from pdserve.bench.metrics import RequestOutput


def served(ttft: float, tpot: float, n: int = 1, tokens: int = 5) -> list[RequestOutput]:
    return [RequestOutput(prompt_len=8, output_tokens=tokens, success=True, ttft=ttft, itl=[tpot] * (tokens - 1),
                          latency=ttft + (tokens - 1) * tpot) for _ in range(n)]


def shed(n: int, after: float = 0.002) -> list[RequestOutput]:
    return [RequestOutput(prompt_len=8, error='HTTP 429: {"error": {"code": "slo_unattainable"}}', latency=after) for _ in range(n)]


def lost(n: int) -> list[RequestOutput]:
    return [RequestOutput(prompt_len=8, error="ReadTimeout: ") for _ in range(n)]


def cell(rate: float, goodput: float, served_n: int = 10) -> Cell:
    return Cell(rate, served_n, served_n, 0, 0, 10.0, goodput, 100.0, 20.0, None)


def test_cell_counts_shed_lost_and_goodput_within_both_targets():
    # 10 s: 3 on time, 1 too slow to first token, 1 too slow per token, 2 shed (429), 1 lost
    outs = served(0.5, 0.1, 3) + served(2.5, 0.1) + served(0.5, 0.3) + shed(2, 0.004) + lost(1)
    c = make_cell(4.0, outs, 10.0, ttft_ms=2000, tpot_ms=250)
    assert (c.sent, c.admitted, c.served, c.shed, c.failed) == (8, 6, 5, 2, 1)
    assert c.goodput == pytest.approx(0.3)  # 3 good / 10 s
    assert c.ttft_p99_ms == pytest.approx(2500, rel=0.05) and c.tpot_p99_ms == pytest.approx(300, rel=0.05)
    assert c.shed_p99_ms == pytest.approx(4.0)


def test_cell_with_nothing_served_has_no_latencies():
    c = make_cell(16.0, shed(3), 2.0, 2000, 250)
    assert (c.served, c.shed, c.goodput, c.ttft_p99_ms, c.tpot_p99_ms) == (0, 3, 0.0, None, None)
    assert "     -        -" in format_cells([("x", c)])[2]


def test_table_ratios_and_goal_checks():
    table = {"vllm": [cell(4, 3.82), cell(8, 0.0)], "disagg": [cell(4, 3.29), cell(8, 4.50)], "colocated": [cell(4, 3.84), cell(8, 4.18)]}
    text = gp.format_table(table)
    lines = text.splitlines()
    assert lines[0].split() == ["goodput", "(req/s)", "4", "req/s", "8", "req/s"]
    assert next(line for line in lines if line.startswith("default / colocated")).split()[-2:] == ["0.86x", "1.08x"]
    assert next(line for line in lines if line.startswith("default / vLLM")).split()[-2:] == ["0.86x", "inf"]
    checks = gp.goal_checks(table)
    assert [ok for _, ok in checks] == [False, False, True, True]  # 4 req/s: below both; 8 req/s: above both
    assert "MISSED default >= pdserve --colocated at 4 req/s: 3.29 vs 3.84 (0.86x)" in text
    assert "met    default >= vLLM CPU 0.32 (float32) at 8 req/s: 4.50 vs 0.00 (inf)" in text
    assert "goals met: 2 of 4" in text


def test_goal_checks_only_for_rows_measured():
    assert gp.goal_checks({"colocated": [cell(4, 1.0)]}) == []
    checks = gp.goal_checks({"disagg": [cell(4, 2.0)], "colocated": [cell(4, 2.0)]})
    assert [ok for _, ok in checks] == [True]  # equal goodput meets ">="
    assert "default / vLLM" not in gp.format_table({"disagg": [cell(4, 2.0)], "colocated": [cell(4, 2.0)]})


def test_a_run_that_served_every_request_on_time_meets_the_goal_whatever_the_last_answers_tail():
    # both served all 120 of 120 within the targets; the colocated run's last answer came 10 ms sooner
    mine, theirs = Cell(4, 120, 120, 0, 0, 35.41, 120 / 35.41, 400.0, 80.0, None), Cell(4, 120, 120, 0, 0, 35.40, 120 / 35.40, 400.0, 80.0, None)
    assert mine.on_time == 120 and mine.goodput < theirs.goodput
    (text, ok), = gp.goal_checks({"disagg": [mine], "colocated": [theirs]})
    assert ok and "default served all 120 on time" in text
    one_late = Cell(4, 120, 120, 0, 0, 35.41, 119 / 35.41, 2100.0, 80.0, None)  # one late: the plain comparison decides
    assert one_late.on_time == 119 and gp.goal_checks({"disagg": [one_late], "colocated": [theirs]})[0][1] is False


def test_rounds_give_each_rate_its_median_run_and_print_each_round():
    rounds = [[cell(4, 3.0), cell(8, 5.0)], [cell(4, 3.5, served_n=7), cell(8, 4.0)], [cell(4, 3.2), cell(8, 6.0)]]
    med = gp.median_cells(rounds)
    assert [c.goodput for c in med] == [3.2, 5.0]
    assert [c.goodput for c in gp.median_cells(rounds[:2])] == [3.0, 4.0]  # even count: the lower middle run
    assert gp.median_cells(rounds[1:2])[0].served == 7  # the whole run's cell, not only its goodput
    text = gp.format_rounds({"disagg": rounds, "colocated": [[cell(4, 3.0), cell(8, 4.0)]] * 3})
    assert "pdserve default 1P+1D    round 3:   3.20   6.00" in text
    assert next(line for line in text.splitlines() if "default / colocated" in line and "round 2" in line).split()[-2:] == ["1.17x", "1.00x"]


def test_overload_summary_counts_runs_within_both_targets():
    good = make_cell(12, served(1.0, 0.2, 5) + shed(5), 20.0, 3000, 400)
    slow = make_cell(12, served(3.5, 0.2, 5), 20.0, 3000, 400)
    lossy = make_cell(12, served(1.0, 0.2, 5) + lost(1), 20.0, 3000, 400)
    all_shed = make_cell(12, shed(4), 20.0, 3000, 400)
    assert [ov.within(c, 3000, 400) for c in (good, slow, lossy, all_shed)] == [True, False, False, False]
    text = ov.format_runs([good, slow, lossy, all_shed], 3000, 400)
    assert "within both targets (TTFT p99 <= 3000 ms, TPOT p99 <= 400 ms) in 1 of 4 runs" in text
    assert "goal (issue 23): MISSED" in text
    run1 = next(line for line in text.splitlines() if line.startswith("run 1"))
    assert run1.split()[3:10] == ["12", "10", "5", "5", "5", "0", "0.25"]  # req/s, offered, admitted, served, shed, lost, goodput
    assert "in 1 of 1 runs" in ov.format_runs([good], 3000, 400) and "goal (issue 23): met" in ov.format_runs([good], 3000, 400)


def test_pdserve_rows_launch_with_the_targets_and_extra_flags(tmp_path):
    args = gp.build_parser().parse_args(["--ttft-ms", "1500", "--extra-launch-arg=--max-num-seqs 64", "--extra-launch-arg=--threads=1"])
    assert gp.pdserve_flags(args, "disagg") == ["--ttft-p99-ms", "1500", "--tpot-p99-ms", "250", "--max-num-seqs", "64", "--threads=1"]
    assert gp.pdserve_flags(args, "colocated")[0] == "--colocated"
    cmd = launch_command(args, gp.pdserve_flags(args, "colocated"), str(tmp_path), 8123)
    assert cmd[1:5] == ["-P", "-m", "pdserve", "launch"] and cmd[cmd.index("--http-port") + 1] == "8123" and "--model" not in cmd


@pytest.mark.parametrize("argv, word", [(["--rows", "vllm,nope"], "nope"), (["--rates", "4,0"], "--rates"), (["--rows", ""], "none given")])
def test_bad_command_lines_are_refused_before_anything_starts(capsys, argv, word):
    assert gp.main(argv) == 2
    assert word in capsys.readouterr().err


def test_cpu_line_names_the_model_and_flags():
    line = cpu_line()
    assert line.startswith("Model name: ") and "; Flags: " in line and "unknown" not in line


def test_one_overload_run_end_to_end(model_dir, tmp_path, capsys):
    """scripts/overload_check for one short run through `pdserve launch` (tiny model, targets
    nothing misses): every request offered is accounted for, and the run is within."""
    out = tmp_path / "o.json"
    code = ov.main(["--runs", "1", "--rate", "8", "--duration-s", "1", "--input-len", "16", "--output-len", "4", "--ttft-ms", "60000",
                    "--tpot-ms", "60000", "--model", str(model_dir), "--extra-launch-arg=--kv-cache-mb 64 --threads 1",
                    "--save-result", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "within both targets (TTFT p99 <= 60000 ms, TPOT p99 <= 60000 ms) in 1 of 1 runs" in text
    (run,) = json.loads(out.read_text())["runs"]
    assert run["sent"] == 8 and run["served"] + run["shed"] == 8 and run["failed"] == 0 and run["within"]
    assert run["ttft_p99_ms"] > 0 and run["tpot_p99_ms"] > 0


def test_the_remote_and_auto_rows_fix_the_default_launchs_path_and_run_only_when_asked():
    args = gp.build_parser().parse_args(["--rows", "disagg,remote,auto,colocated"])
    assert gp.parse_rows(args.rows) == ["disagg", "remote", "auto", "colocated"]
    assert gp.parse_rows(gp.build_parser().parse_args([]).rows) == list(gp.ROWS) and not {"remote", "auto"} & set(gp.ROWS)
    assert gp.pdserve_flags(args, "auto")[:2] == ["--paths", "auto"] and gp.pdserve_flags(args, "remote")[:2] == ["--paths", "remote"]
    table = {"disagg": [cell(4, 3.0)], "remote": [cell(4, 2.9)], "auto": [cell(4, 3.5)], "colocated": [cell(4, 3.4)]}
    text = gp.format_table(table)
    assert (text.index("pdserve default 1P+1D") < text.index("pdserve 1P+1D paths remote") < text.index("pdserve 1P+1D paths auto")
            < text.index("pdserve --colocated"))


def test_a_launch_is_measured_once_every_worker_it_starts_is_registered():
    """/health is ready with a decode worker alone; the harness waits for the launch's count."""
    from benchmarks.servers import launch_workers

    assert launch_workers([]) == 2 and launch_workers(["--colocated", "--ttft-p99-ms", "2000"]) == 1
    assert launch_workers(["--prefill", "0", "--decode", "2", "--threads", "1"]) == 2
    assert launch_workers(["--planner", "--decode", "3"]) == 4
