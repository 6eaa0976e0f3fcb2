"""Coordinator overhead: a real coordinator process driven by stub workers that answer at once.

Lifecycle: `measure_overhead` starts `pdserve coordinator` (tokenizer only) and one stub worker
process (`python -m pdserve.bench.overhead --stub-worker ADDR`) that speaks the real worker
protocol as a COLOCATED worker: Hello, Heartbeats, and for every Generate one TokenBatch item
carrying a token and finish_reason=length, sent as soon as it is read. A lean load generator in
this process (one DEALER, pre-encoded GenerateRequests) then (1) sends requests one at a time
and times each round trip to its Final: with the stub at zero cost this is the latency the
coordinator adds (two extra loopback hops included); (2) keeps `window` requests in flight and
counts completions per second. The coordinator's own CPU seconds per request (all its threads,
ZeroMQ's I/O thread included) are read from /proc: what one core could sustain, whatever the load
generator sharing the CPUs costs.
Both processes are stopped at the end, whatever happened.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from pdserve.ports import free_port

GOAL_RPS = 10_000
GOAL_P99_MS = 1.0


# ------------------------------------------------------------------ the stub worker

def stub_worker(address: str, worker_id: str = "stub-0", heartbeat_s: float = 0.5) -> None:
    """Register as a COLOCATED worker and answer every Generate with one final token at once."""
    import zmq

    from pdserve.kvtransfer.pool import host_identity
    from pdserve.wire.protocol import (
        PROTOCOL_VERSION,
        CoordinatorToWorker,
        Generate,
        Heartbeat,
        Hello,
        Reject,
        Role,
        Shutdown,
        TokenBatch,
        TokenOut,
        Welcome,
    )
    from pdserve_client.protocol import FinishReason, decoder, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    dec = decoder(CoordinatorToWorker)
    host, boot = host_identity()
    hello = encode(Hello(PROTOCOL_VERSION, worker_id, Role.COLOCATED, os.getpid(), host, boot, "stub", 1 << 20, 1 << 20, 16))
    beat = encode(Heartbeat(worker_id, 1 << 20, 0, 0, 0))
    registered = False
    next_beat = 0.0
    while True:
        now = time.monotonic()
        if now >= next_beat:
            sock.send(beat if registered else hello)
            next_beat = now + (heartbeat_s if registered else 0.1)
        if not sock.poll(max(1, int((next_beat - time.monotonic()) * 1000))):
            continue
        items = []
        while True:  # drain what has arrived, answer it in one batch
            try:
                msg = dec.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, Generate):
                items.append(TokenOut(msg.request_id, msg.prompt_token_ids[0], None, None, FinishReason.LENGTH))
            elif isinstance(msg, Welcome):
                registered = True
            elif isinstance(msg, (Shutdown, Reject)):
                return
        if items:
            sock.send(encode(TokenBatch(items)))


# ------------------------------------------------------------------ load generator

class LoadGenerator:
    """One DEALER on the coordinator's client port; requests are pre-encoded so the client
    spends its time on the socket, not on building messages."""

    def __init__(self, address: str, prompt: list[int]):
        import zmq

        from pdserve_client.protocol import CoordinatorToClient, decoder

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.dec = decoder(CoordinatorToClient)
        self.prompt = prompt

    def encoded(self, prefix: str, n: int) -> list[bytes]:
        from pdserve_client.params import SamplingParams
        from pdserve_client.protocol import GenerateRequest, encode

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        return [encode(GenerateRequest(f"{prefix}{i}", params, token_ids=self.prompt)) for i in range(n)]

    def finals(self, timeout_s: float = 30.0):
        """Yield (request_id, error or None) for each request that ended, as messages arrive."""
        from pdserve_client.protocol import ErrorReply, Final

        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("the coordinator stopped answering")
        while True:
            try:
                msg = self.dec.decode(self.sock.recv(self.zmq.NOBLOCK))
            except self.zmq.Again:
                return
            if isinstance(msg, Final):
                yield msg.request_id, None
            elif isinstance(msg, ErrorReply):
                yield msg.request_id, msg.code

    def sequential(self, n: int) -> list[float]:
        """Round-trip seconds of n requests sent one at a time."""
        lat = []
        for i, body in enumerate(self.encoded("s", n)):
            t0 = time.perf_counter()
            self.sock.send(body)
            while not any(rid == f"s{i}" for rid, _ in self.finals()):
                pass
            lat.append(time.perf_counter() - t0)
        return lat

    def windowed(self, n: int, window: int) -> tuple[float, list[float], int]:
        """Keep `window` requests in flight until n have ended: (seconds, latencies, errors)."""
        bodies = self.encoded("w", n)
        sent_at: dict[str, float] = {}
        lat, errors, nxt = [], 0, 0
        t0 = time.perf_counter()
        while len(lat) + errors < n:
            while nxt < n and len(sent_at) < window:
                sent_at[f"w{nxt}"] = time.perf_counter()
                self.sock.send(bodies[nxt])
                nxt += 1
            for rid, err in self.finals():
                start = sent_at.pop(rid, None)
                if start is None:
                    continue  # a late answer from the warm-up
                if err is None:
                    lat.append(time.perf_counter() - start)
                else:
                    errors += 1
        return time.perf_counter() - t0, lat, errors

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ------------------------------------------------------------------ the measurement

def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def wait_registered(client_addr: str, worker_id: str, procs, timeout: float = 60.0) -> None:
    from pdserve_client.library import Client, ClientError

    deadline = time.monotonic() + timeout
    with Client(client_addr, timeout=2.0) as c:
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[2:4]} exited with code {p.returncode}")
            try:
                if any(w["id"] == worker_id for w in c.stats(timeout=1.0)["workers"]):
                    return
            except ClientError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"stub worker not registered after {timeout:.0f}s")


def coordinator_stats(client_addr: str) -> dict:
    from pdserve_client.library import Client

    with Client(client_addr, timeout=5.0) as c:
        return c.stats()


def percentile_ms(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values or [0.0]) * 1000.0, p))


def measure_overhead(tokenizer: str | None, num_requests: int = 20000, window: int = 256, sequential: int = 2000,
                     log=None) -> dict:
    """Start coordinator + stub, measure; returns a dict of figures (see format_overhead)."""
    client_addr, worker_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    coord_cmd = [sys.executable, "-P", "-m", "pdserve", "coordinator", "--clients", client_addr, "--workers", worker_addr]
    coord = subprocess.Popen(coord_cmd + (["--model", tokenizer] if tokenizer else []), stdout=log, stderr=subprocess.STDOUT if log else None)
    stub = subprocess.Popen([sys.executable, "-m", "pdserve.bench.overhead", "--stub-worker", worker_addr], stdout=log,
                            stderr=subprocess.STDOUT if log else None)
    gen = None
    try:
        wait_registered(client_addr, "stub-0", (coord, stub))
        gen = LoadGenerator(client_addr, [42, 43, 44, 45])
        gen.sequential(min(100, sequential))  # warm-up: connections, code paths
        seq = gen.sequential(sequential)
        cpu0 = cpu_seconds(coord.pid)
        seconds, lat, errors = gen.windowed(num_requests, window)
        cpu1 = cpu_seconds(coord.pid)
        stats = coordinator_stats(client_addr)
    finally:
        if gen is not None:
            gen.close()
        for p in (stub, coord):
            p.terminate()
        for p in (stub, coord):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    cpu_per_req = (cpu1 - cpu0) / num_requests if cpu0 is not None and cpu1 is not None else None
    return {
        "requests": num_requests, "window": window, "seconds": seconds, "errors": errors, "rps": len(lat) / seconds,
        "load_mean_ms": 1000.0 * sum(lat) / max(1, len(lat)), "load_p99_ms": percentile_ms(lat, 99),
        "sequential": sequential, "seq_p50_ms": percentile_ms(seq, 50), "seq_p99_ms": percentile_ms(seq, 99),
        "coordinator_cpu_us": None if cpu_per_req is None else cpu_per_req * 1e6,
        "capacity_rps": None if not cpu_per_req else 1.0 / cpu_per_req,
        "finished": stats["requests"].get("finished:length", 0),
    }


def format_overhead(r: dict) -> str:
    def line(label, value):
        return f"{label:<44} {value:<10.2f}" if isinstance(value, float) else f"{label:<44} {value}"

    cpu = r["coordinator_cpu_us"]
    rps_ok = "met" if r["rps"] >= GOAL_RPS else f"MISSED by {GOAL_RPS / r['rps']:.2f}x"
    p99_ok = "met" if r["seq_p99_ms"] <= GOAL_P99_MS else f"MISSED by {r['seq_p99_ms'] - GOAL_P99_MS:.2f} ms"
    lines = [
        f"{' Coordinator overhead (stub workers) ':=^56}",
        line("Requests (in flight):", f"{r['requests']} ({r['window']})"),
        line("Failed requests:", r["errors"]),
        line("Duration (s):", r["seconds"]),
        line("Request throughput (req/s):", r["rps"]),
        line("Mean / P99 latency under that load (ms):", f"{r['load_mean_ms']:.2f} / {r['load_p99_ms']:.2f}"),
        line("Coordinator CPU per request (us, all threads):", "n/a" if cpu is None else f"{cpu:.1f}"),
        line("Requests/s that CPU time allows on one core:", "n/a" if r["capacity_rps"] is None else f"{r['capacity_rps']:.0f}"),
        line("One at a time: requests:", r["sequential"]),
        line("Median / P99 added latency (ms):", f"{r['seq_p50_ms']:.3f} / {r['seq_p99_ms']:.3f}"),
        line(f"Goal >= {GOAL_RPS} req/s:", rps_ok),
        line(f"Goal added p99 <= {GOAL_P99_MS} ms:", p99_ok),
        "=" * 56,
    ]
    return "\n".join(lines)


def run_overhead(args) -> int:
    """`pdserve bench --stub-coordinator`: --num-prompts requests, --max-concurrency in flight."""
    r = measure_overhead(args.tokenizer or args.model, args.num_prompts, args.max_concurrency or 256, min(2000, args.num_prompts),
                         log=subprocess.DEVNULL)
    print(format_overhead(r))
    if args.save_result:
        import json

        with open(args.save_result, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["errors"] == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--stub-worker":
        stub_worker(sys.argv[2])
    else:
        sys.exit("usage: python -m pdserve.bench.overhead --stub-worker tcp://HOST:PORT")
