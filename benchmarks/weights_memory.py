"""`python -m benchmarks.weights_memory`: the memory a node's workers hold, RSS and PSS per worker,
with the weight cache (runtime.weight_cache: one copy of the re-laid-out weights per node) and
without it (PDSERVE_WEIGHT_CACHE=off: each worker's private copies, as before).

Lifecycle: one run in this process. For each layout it starts a node with `pdserve.launch`'s
Launcher (coordinator + workers as real processes, --threads 1, a small KV pool), waits until the
workers are registered, sends one greedy request, reads every worker's /proc/PID/smaps_rollup
(Rss, Pss, Private_Dirty, Shared_Clean) and /proc/PID/smaps (the Rss / Pss of the GGUF's and the
cache files' mappings: "weights (files)"), stops the node, and prints one row per worker. Layouts:
`1+1 cold` (1 prefill + 1 decode, an empty cache directory: the first worker makes the files),
`1+1 warm` (again, the files made), `1+1 off` (no cache) and `1 worker` (one colocated worker,
warm cache). The cache lives in a temporary directory (--cache-dir to keep it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from benchmarks.machine import cpu_line, load_line


def rollup(pid: int) -> dict[str, int]:
    """Rss, Pss, Private_Dirty, Shared_Clean, Private_Clean of a process, kB."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Private_Dirty", "Shared_Clean", "Private_Clean"):
                out[k] = int(v.split()[0])
    return out


def file_maps(pid: int, roots: list[str]) -> dict[str, int]:
    """Rss and Pss (kB) of the mappings of files under `roots` in process `pid`, summed."""
    out, inside = {"Rss": 0, "Pss": 0}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):
                inside = len(fields) > 5 and any(fields[5].startswith(r) for r in roots)
            elif inside and fields[0][:-1] in out:
                out[fields[0][:-1]] += int(fields[1])
    return out


def measure(model: str, layout: str, cache: str, threads: int, kv_mb: int, timeout: float) -> list[tuple[str, dict]]:
    from pdserve.common.model_path import resolve_model_path
    from pdserve.launch import Launcher, NodePlan
    from pdserve.ports import free_port
    from pdserve_client.library import Client

    os.environ["PDSERVE_WEIGHT_CACHE"] = "off" if layout.endswith("off") else cache
    counts = dict(prefill=0, decode=0, colocated=1) if layout == "1 worker" else dict(prefill=1, decode=1, colocated=0)
    plan = NodePlan(**counts, model=model, client_addr=f"tcp://127.0.0.1:{free_port()}", worker_addr=f"tcp://127.0.0.1:{free_port()}",
                    engine_args=["--kv-cache-mb", str(kv_mb)], threads=threads, name="mem", launch_keys=False,
                    coordinator_args=["--no-slo"])  # one request, whatever the machine's load
    log_dir = tempfile.mkdtemp(prefix="pdserve-mem-")
    launcher = Launcher(plan, log_dir=log_dir)
    t0 = time.monotonic()
    launcher.start()
    try:
        launcher.wait_ready(timeout)
        ready = time.monotonic() - t0
        with Client(plan.client_addr, timeout=120) as c:
            c.generate(token_ids=list(range(100, 164)), max_tokens=16, temperature=0.0, ignore_eos=True)
        roots = [str(resolve_model_path(model).resolve()), cache]
        rows = []
        for name, proc in launcher.procs:
            if name.startswith(("prefill", "decode", "colocated")):
                rows.append((name, {**rollup(proc.pid), **{f"w_{k}": v for k, v in file_maps(proc.pid, roots).items()}, "ready_s": ready}))
        return rows
    finally:
        launcher.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--cache-dir", default=None, help="the weight cache's directory (default: a temporary one, removed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--layouts", default="1+1 cold,1+1 warm,1+1 off,1 worker")
    args = ap.parse_args(argv)
    from pdserve.common.model_path import resolve_model_path

    model = str(resolve_model_path(args.model))
    cache = args.cache_dir or tempfile.mkdtemp(prefix="pdserve-wcache-")
    print(cpu_line())
    print(load_line())
    print(f"model {model} ({os.path.getsize(model) / 2**20:.0f} MiB), KV pool {args.kv_cache_mb} MiB a worker, --threads {args.threads}")
    print(f"{'layout':10} {'worker':11} {'RSS':>8} {'PSS':>8} {'priv.dirty':>10} {'shared':>8} {'weights RSS':>11} {'weights PSS':>11} {'ready':>6}  (MiB; s)")
    try:
        for layout in args.layouts.split(","):
            rows = measure(model, layout, cache, args.threads, args.kv_cache_mb, args.timeout)
            for name, r in rows:
                print(f"{layout:10} {name:11} {r['Rss'] / 1024:8.1f} {r['Pss'] / 1024:8.1f} {r['Private_Dirty'] / 1024:10.1f} "
                      f"{r['Shared_Clean'] / 1024:8.1f} {r['w_Rss'] / 1024:11.1f} {r['w_Pss'] / 1024:11.1f} {r['ready_s']:6.1f}")
            if len(rows) > 1:
                print(f"{layout:10} {'sum':11} {sum(r['Rss'] for _, r in rows) / 1024:8.1f} {sum(r['Pss'] for _, r in rows) / 1024:8.1f} "
                      f"{sum(r['Private_Dirty'] for _, r in rows) / 1024:10.1f} {'':8} {'':11} {sum(r['w_Pss'] for _, r in rows) / 1024:11.1f}")
    finally:
        if args.cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    print(load_line())


if __name__ == "__main__":
    main()
