"""One copy of the weights per node: a 1 + 1 launch on a GGUF (keep_quantized, the default) maps
the GGUF and the node's weight-cache files (runtime.weight_cache: q/k/v and gate/up joined, the
16-row GEMV copies) read-only in both workers, whose pages are then shared: each file mapped in
both, with Shared_Clean pages in both and a PSS summed over the two workers under 1.5x one
worker's resident bytes of it (two private copies would sum to 2x)."""
import os

import pytest

from pdserve.common.model_path import default_model_path
from pdserve_client.library import Client
from tests.helpers import save_tiny_served_model, start_cluster, write_gguf


def file_maps(pid: int, roots: list[str]) -> dict[str, dict[str, int]]:
    """{file: {Rss, Pss, Shared_Clean, Private_Clean, Private_Dirty} in kB, summed over its
    mappings} of the files under `roots` that process `pid` maps (/proc/PID/smaps)."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode, path
                path = fields[5] if len(fields) > 5 else ""
                cur = out.setdefault(path, {}) if any(path.startswith(r) for r in roots) else None
            elif cur is not None and fields[0][:-1] in ("Rss", "Pss", "Shared_Clean", "Private_Clean", "Private_Dirty"):
                cur[fields[0][:-1]] = cur.get(fields[0][:-1], 0) + int(fields[1])
    return out


@pytest.mark.timeout(300)  # measured 222-224 s at a load average of ~13 on 2 cores (a worker start on a GGUF: load, back-end table, profile)
def test_a_launch_maps_one_copy_of_the_weights(tmp_path, monkeypatch):
    save_tiny_served_model(tmp_path / "hf", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, tmp_path / "hf", "Q8_0", tokenizer_from=default_model_path())
    os.sync()  # the file's pages written back: smaps counts pages not yet written back as dirty in every mapping of them
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", str(cache))
    launcher = start_cluster(gguf, tmp_path / "logs", prefill=1, decode=1)
    try:
        with Client(launcher.plan.client_addr, timeout=60) as c:
            assert len(c.generate(token_ids=list(range(10, 40)), max_tokens=8, temperature=0.0, ignore_eos=True).token_ids) == 8
        pids = [p.pid for name, p in launcher.procs if name.startswith(("prefill", "decode"))]
        assert len(pids) == 2
        maps = [file_maps(pid, [str(cache), str(gguf.resolve())]) for pid in pids]
    finally:
        launcher.stop()
    made = {str(p) for p in cache.rglob("*.bin")}  # also the un-permuted q / k rows, mapped only while q/k/v are joined
    kept = set(maps[0]) - {str(gguf.resolve())}
    assert kept and kept <= made and set(maps[1]) == set(maps[0]), "the workers map different files"
    for files in maps:
        assert str(gguf.resolve()) in files
        dirty = {f: v for f, v in files.items() if v.get("Private_Dirty")}
        assert not dirty, f"pages written into the mapped weights: {dirty}"  # nothing written into them
    both = [f for f in maps[0] if all(m[f].get("Rss") for m in maps)]
    assert both and all(m[f].get("Shared_Clean", 0) > 0 for f in both for m in maps)
    pss = sum(m[f]["Pss"] for f in both for m in maps)
    one = max(sum(m[f]["Rss"] for f in both) for m in maps)
    assert pss < 1.5 * one, (pss, one)
