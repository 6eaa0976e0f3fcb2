"""What a long prompt's hand-off costs after its prefill: the time from the end of the prompt's
last prefill step to the decode worker holding its KV and starting it (its first token sent:
KVReady taken, the request joined; its first decode step runs next), with the streamed hand-off
(worker/handoff.py, per chunk) and without it (`--no-handoff-stream`), over shm and tcp.

Lifecycle: two real `pdserve worker` processes (one prefill, one decode; prefix cache off, so
every trial computes its whole prompt) register with a minimal coordinator this script plays on
the worker port (Hello -> Welcome); per trial it sends Admit to the decode worker, the Prefill
with its grant to the prefill worker, and stamps (CLOCK_MONOTONIC, one clock for every process
of the machine) the PrefillDone and the decode worker's first TokenBatch as they arrive:
  last step end = PrefillDone's arrival - its kv_seconds (the KVReady's send, which starts as
  the step ends), hand-off = first token's arrival - last step end (both loopback messages: ~0.1 ms).
Each (backend, streaming) pair starts its own two workers; the first trial of each warms up and
is dropped, the median of the rest is printed with the KV bytes a prompt moves.

  python -m benchmarks.handoff_cost --prompt-tokens 2048 6000 --trials 3          # the default model
  python -m benchmarks.handoff_cost --kv-shape-1b --prompt-tokens 2048 8192       # 16 layers x 8 KV heads of 64
  python -m benchmarks.handoff_cost --kv-shape-1b --link-gbit 1                   # tcp between network namespaces at 1 Gbit/s (root)

`--kv-shape-1b` writes (HF transformers, random weights, in a temp dir) a checkpoint with a 1B
Llama-3's KV shape (16 layers, 8 KV heads of 64: 64 KiB a token in fp32) and a narrow MLP and
width (hidden 512), so that its prefill is feasible on a small CPU: the hand-off moves a 1B
model's KV; its compute per chunk is less than a 1B model's (which only lengthens the chunks the
streamed parts hide behind).

Measured 2026 (2 shared cores, load average 8-15 from other jobs: noisy; one trial after a
warm-up): the default model (Q4_1 kept), a 2,048-token prompt (90 MiB of fp32 KV) in chunks of
512, 1 thread per worker: hand-off 292 ms whole vs 76 ms streamed over shm, 425 ms vs 76 ms
over tcp (loopback). With chunks of 2,048 the same prompt is one chunk and nothing streams.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from benchmarks.netns import hosts
from pdserve.ports import free_port
from pdserve.wire.protocol import (
    PROTOCOL_VERSION,
    Admit,
    Granted,
    Hello,
    Prefill,
    PrefillDone,
    TokenBatch,
    Welcome,
    WorkerError,
    WorkerToCoordinator,
)
from pdserve_client.params import SamplingParams
from pdserve_client.protocol import decoder, encode

LINK_SUBNET = "10.232.78"  # --link-gbit: the namespaces' private subnet; this script's coordinator on the bridge, .254
LINK_HOSTS = {"p": 2, "d": 3}  # host (the role's initial) -> its address's last number


class Coordinator:
    """The worker port's side of the protocol, as little as a hand-off needs."""

    def __init__(self, host: str = "127.0.0.1"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.address = f"tcp://{host}:{free_port()}"
        self.sock.bind(self.address)
        self.decode = decoder(WorkerToCoordinator)
        self.workers: dict[str, tuple[bytes, Hello]] = {}  # role name -> (ident, Hello)

    def recv(self, timeout: float):
        """(arrival time, ident, message), answering Hellos; None on timeout."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                continue
            ident, body = self.sock.recv_multipart()
            t = time.monotonic()
            msg = self.decode.decode(body)
            if isinstance(msg, Hello):
                self.workers[msg.role.name.lower()] = (ident, msg)
                self.sock.send_multipart([ident, encode(Welcome(PROTOCOL_VERSION))])
                continue
            return t, ident, msg
        return None

    def wait_for(self, roles: set[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not roles <= set(self.workers):
            assert time.monotonic() < deadline, f"workers {roles - set(self.workers)} never said Hello"
            self.recv(0.2)

    def send(self, role: str, msg) -> None:
        self.sock.send_multipart([self.workers[role][0], encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def start_worker(role: str, coordinator: str, model: str | None, args, stream: bool, backend: str, log, net=None) -> subprocess.Popen:
    """One worker; with net (--link-gbit) inside its own host's namespace, its KV port on that host's address."""
    where = [] if net is None else ["--kv-bind", f"tcp://{net.subnet}.{LINK_HOSTS[role[0]]}:*", "--insecure"]
    cmd = [sys.executable, "-P", "-m", "pdserve", "worker", "--role", role, "--coordinator", coordinator,
           "--kv-backend", backend, "--threads", str(args.threads), "--no-prefix-cache", "--kv-cache-mb", str(args.kv_cache_mb),
           "--max-num-batched-tokens", str(args.chunk), "--worker-id", f"bench-{role}",
           "--handoff-stream" if stream else "--no-handoff-stream", *(["--model", model] if model else []),
           *where, *args.worker_arg]
    return subprocess.Popen(cmd if net is None else net.run(role[0], cmd), stdout=log, stderr=subprocess.STDOUT)


def trial(coord: Coordinator, rid: str, prompt: list[int]) -> dict:
    """One prompt through the pair: its timings (seconds)."""
    writer = coord.workers["prefill"][1]  # named, as the coordinator does: its grant waits while it lives (a slow prefill)
    coord.send("decode", Admit(rid, len(prompt), 1, writer.pid, writer.host, writer.boot_id))
    while True:
        got = coord.recv(60)
        assert got is not None, "no Granted"
        _, _, g = got
        if isinstance(g, Granted) and g.request_id == rid:
            break
    t_sent = time.monotonic()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    decode = coord.workers["decode"][1]
    coord.send("prefill", Prefill(rid, prompt, params, decode.worker_id, decode.kv_endpoint, g.block_ids, grant=g.grant,
                                  dest_cached_blocks=g.cached_blocks))
    done = first = None
    while done is None or first is None:
        got = coord.recv(1200)
        assert got is not None, "the hand-off never ended"
        t, _, msg = got
        if isinstance(msg, WorkerError):
            raise RuntimeError(f"{msg.code}: {msg.message}")
        if isinstance(msg, PrefillDone) and msg.request_id == rid:
            done = (t, msg)
        elif isinstance(msg, TokenBatch) and first is None and any(i.request_id == rid for i in msg.items):
            first = t
    t_done, pd = done
    last_step_end = t_done - pd.kv_seconds
    while True:  # its second token: the first decode step's (the request ends there: max_tokens 2)
        got = coord.recv(60)
        assert got is not None, "no decode step"
        t, _, msg = got
        if isinstance(msg, TokenBatch) and any(i.request_id == rid and i.finish_reason is not None for i in msg.items):
            break
    return {"handoff": first - last_step_end, "send_after_last_step": pd.kv_seconds, "ttft": first - t_sent,
            "first_decode_step_end": t - last_step_end, "kv_bytes": pd.kv_bytes}


def write_kv_shape_1b(directory: str) -> str:
    """A random checkpoint with a 1B Llama-3's KV shape, the default model's tokenizer beside it."""
    import transformers

    from pdserve.common.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024, num_hidden_layers=16,
                                   num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=32768,
                                   rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--kv-shape-1b", action="store_true", help="a random checkpoint with a 1B Llama-3's KV shape (see above)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 6000])
    ap.add_argument("--backends", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp"])
    ap.add_argument("--handoff-stream", action=argparse.BooleanOptionalAction, default=None,
                    help="only streamed (--handoff-stream) or only whole (--no-handoff-stream) hand-offs; default: both")
    ap.add_argument("--trials", type=int, default=3, help="per cell, after one warm-up")
    ap.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens: the prefill chunk")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per worker")
    ap.add_argument("--kv-cache-mb", type=int, default=2048)
    ap.add_argument("--worker-arg", action="append", default=[], help="one more worker flag (repeat)")
    ap.add_argument("--link-gbit", type=float, default=0.0,
                    help="tcp only: each worker in a network namespace of its own, the links shaped to this rate (tc tbf; root)")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    if args.link_gbit:
        args.backends = ["tcp"]
    from benchmarks.machine import load_line, machine

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="handoff-cost-")
    os.makedirs(log_dir, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="kv-shape-1b-") if args.kv_shape_1b else None
    model = write_kv_shape_1b(tmp.name) if tmp is not None else args.model
    link = f", workers in network namespaces on a {args.link_gbit:g} Gbit/s link (tc tbf)" if args.link_gbit else ""
    print(f"# {machine()}\n# {load_line()}\n# model: {model or 'default'}, chunk {args.chunk} tokens, {args.threads} threads per worker{link}")
    print("prompt  backend  stream  kv_MiB  handoff_ms  send_after_last_step_ms  first_decode_step_end_ms  ttft_s")
    modes = [args.handoff_stream] if args.handoff_stream is not None else [False, True]
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(hosts(LINK_SUBNET, LINK_HOSTS, args.link_gbit)) if args.link_gbit else None
        for backend in args.backends:
            for stream in modes:
                run_pair(args, model, log_dir, backend, stream, net)
    print(f"# {load_line()}")
    if tmp is not None:
        tmp.cleanup()


def run_pair(args, model: str | None, log_dir: str, backend: str, stream: bool, net) -> None:
    """One (backend, streaming) pair of workers through every prompt length: a row each."""
    coord = Coordinator(f"{net.subnet}.254" if net is not None else "127.0.0.1")
    with open(os.path.join(log_dir, f"{backend}-{'stream' if stream else 'whole'}.log"), "w") as log:
        procs = [start_worker(role, coord.address, model, args, stream, backend, log, net) for role in ("decode", "prefill")]
        try:
            coord.wait_for({"decode", "prefill"})
            for n in args.prompt_tokens:
                prompt = [1000 + (31 * j) % 20000 for j in range(n)]
                rows = [trial(coord, f"{backend}-{stream}-{n}-{i}", prompt) for i in range(args.trials + 1)][1:]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                print(f"{n:6d}  {backend:7s}  {'on' if stream else 'off':6s}  {med['kv_bytes'] / 2**20:6.1f}  "
                      f"{1000 * med['handoff']:10.1f}  {1000 * med['send_after_last_step']:23.1f}  "
                      f"{1000 * med['first_decode_step_end']:24.1f}  {med['ttft']:6.2f}", flush=True)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            coord.close()


if __name__ == "__main__":
    main()
