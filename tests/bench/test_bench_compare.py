"""scripts/compare end to end, small: pdserve disaggregated through a real cluster and HF
transformers as one static batch on the same requests, in one table with the ratio; the
llama.cpp row is skipped with its reason where it cannot run (no GGUF for a safetensors model)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_compare_table_small(model_dir, tmp_path):
    out = tmp_path / "c.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.compare", "--model", str(model_dir), "--num-prompts", "3", "--input-len", "16",
                        "--output-len", "4", "--rows", "disagg,hf-batch,llama-cpp", "--sections", "rows", "--disable-tqdm",
                        "--save-result", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split("  ")[0]: line for line in r.stdout.splitlines()}
    assert lines["pdserve disaggregated 1P+1D"].split()[3] == "3/3" and lines["pdserve disaggregated 1P+1D"].endswith("1.00x")
    assert "3/3" in lines["HF generate, static batch"] and "(goal >= 2x:" in lines["HF generate, static batch"]
    assert "llama.cpp server" in r.stdout and "skipped:" in r.stdout.split("llama.cpp server", 1)[1].splitlines()[0]
    saved = json.loads(out.read_text())
    disagg, hf = saved["rows"]["disagg"], saved["rows"]["hf-batch"]
    assert disagg["total_output"] == hf["total_output"] == 12 and disagg["total_input"] == hf["total_input"] == 48
    assert "llama-cpp" in saved["skipped"] and "cores" in saved["machine"]
