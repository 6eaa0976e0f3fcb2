"""benchmarks/structured.py, run small on the tiny model: through a launched service's HTTP
gateway (its default) and in one in-process engine, each prints every row and the figure (the
script itself checks that every free request got all its tokens and that the others outlasted
them)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", [["--log-dir"], ["--in-process"]], ids=["launched", "in-process"])
def test_bench_structured_runs_and_prints_the_figure(model_dir, tmp_path, mode):
    args = [*mode, str(tmp_path)] if mode == ["--log-dir"] else mode
    out = subprocess.run([sys.executable, "-m", "benchmarks.structured", "--model-path", str(model_dir), "--free", "2", "--others", "2",
                          "--tokens", "4", "--repeats", "1", *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^2 free requests (.+?): ([\d.]+) free tok/s", out.stdout, re.M)
    assert [label for label, _ in rows] == ["alone", "beside 2 free", "beside 2 json schema", "beside 2 regex"], out.stdout
    assert all(float(rate) > 0 for _, rate in rows)
    assert re.search(r"^FIGURE: free requests' throughput beside constrained ones: [+-][\d.]+% vs beside free ones", out.stdout, re.M)
    if mode == ["--log-dir"]:
        assert {"coordinator.log", "gateway.log", "prefill-0.log", "decode-0.log"} <= {p.name for p in tmp_path.iterdir()}
