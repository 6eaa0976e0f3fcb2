"""Issue 26's figures for `pdserve launch --ray`: Ray's own memory and CPU on this machine, the
time to first token of a request that finds no worker (cold start), and the scale-up time.

Lifecycle: start a local Ray cluster (ray.cluster_utils.Cluster: a head without CPUs and --nodes
nodes of one CPU, no dashboard, 80 MiB object stores) -> sample Ray's processes (every process
under this one but the launch's: RSS now, CPU over --idle-s) -> start `pdserve launch --ray ADDR
--min-replicas 0 --max-replicas decode=2 --downscale-delay-s 3 --engine-arg=--max-num-seqs=2`
on --model (default: the default model) -> wait until every worker has idled away, sample Ray
again (its idle worker processes included) -> one greedy request: its time to the first token
(the cold start: actors placed, workers started, model loaded, registered, prefilled) -> wait
for zero again, then a burst of --burst requests: the launcher's "registered N s after it was
asked for" lines give each added worker's start, the second decode worker's is the scale-up ->
stop everything. Prints one line per figure; the machine is whatever else runs on it.

    python -m benchmarks.ray_scaling [--model PATH] [--nodes 2] [--idle-s 20] [--burst 8]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from pdserve.ports import free_port
from pdserve_client.library import AsyncClient, Client, ClientError

OBJECT_STORE = 80 * 2**20
TICK = os.sysconf("SC_CLK_TCK")


def tree(root: int) -> set[int]:
    """root's descendants (not root)."""
    children: dict[int, list[int]] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def usage(pids: set[int]) -> tuple[int, float]:
    """(RSS bytes, CPU seconds so far) summed over pids."""
    rss, cpu = 0, 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / TICK
            rss += next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        except (OSError, StopIteration, IndexError):
            pass
    return rss, cpu


def ray_sample(exclude: int | None, idle_s: float, what: str) -> None:
    def ray_pids():
        return tree(os.getpid()) - ({exclude} | tree(exclude) if exclude else set())

    rss, cpu0 = usage(ray_pids())
    time.sleep(idle_s)
    pids = ray_pids()
    _, cpu1 = usage(pids)
    print(f"ray's own processes ({what}): {len(pids)} processes, RSS {rss / 2**20:.0f} MiB, CPU {100 * (cpu1 - cpu0) / idle_s:.1f}% "
          f"of one core over {idle_s:g} s idle", flush=True)


def wait_workers(clients: str, want, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with Client(clients, timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                if want(len(c.stats()["workers"])):
                    return
            except ClientError:
                pass
            time.sleep(0.2)
    raise TimeoutError("workers did not reach the count in time")


async def first_token_s(clients: str) -> float:
    async with AsyncClient(clients, timeout=300) as c:
        t0 = time.monotonic()
        async for d in c.stream(prompt="Tell me about Paris.", temperature=0, max_tokens=8):
            if d.token_ids:
                return time.monotonic() - t0
    raise RuntimeError("no token")


async def burst(clients: str, n: int) -> None:
    async with AsyncClient(clients, timeout=600) as c:
        await asyncio.gather(*(c.generate(prompt=f"Story {i}:", temperature=0, max_tokens=128, ignore_eos=True) for i in range(n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--burst", type=int, default=8)
    args = ap.parse_args(argv)
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, object_store_memory=OBJECT_STORE))
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    print(f"ray cluster of {args.nodes + 1} nodes up in {time.monotonic() - t0:.1f} s", flush=True)
    proc, log = None, tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    try:
        ray_sample(None, args.idle_s, "the bare cluster")
        clients, workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        proc = subprocess.Popen([sys.executable, "-P", "-m", "pdserve", "launch", "--ray", cluster.address, "--no-gateway", "--clients", clients,
                                 "--workers", workers, "--threads", "1", "--ray-num-cpus", "0.5", "--min-replicas", "0",
                                 "--max-replicas", "decode=2", "--downscale-delay-s", "3", "--cold-start-s", "30", "--ttft-p99-ms", "60000",
                                 "--no-slo", "--engine-arg=--max-num-seqs=2", "--engine-arg=--kv-cache-mb=64",
                                 *(["--model", args.model] if args.model else [])], stderr=log)
        wait_workers(clients, lambda n: n >= 2, 300)
        wait_workers(clients, lambda n: n == 0, 120)
        ray_sample(proc.pid, args.idle_s, "with the launch, no worker")
        print(f"cold start, time to first token: {asyncio.run(first_token_s(clients)):.2f} s", flush=True)
        wait_workers(clients, lambda n: n == 0, 120)
        start = len(open(log.name).read())
        asyncio.run(burst(clients, args.burst))
        added = re.findall(r"ray: (\w+) worker (\S+) registered ([\d.]+) s after", open(log.name).read()[start:])
        print("burst: workers added and their start (asked -> registered): "
              + ", ".join(f"{wid} {s} s" for _, wid, s in added), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        cluster.shutdown()
        print(f"launch log: {log.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
