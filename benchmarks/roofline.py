"""Hardware ceilings and how close pdserve gets: the decode-step roofline and the KV hand-off rate.

Lifecycle: everything runs in this process on `threads` torch threads (the decode worker's
share of the cores). `machine_rates` measures the two ceilings once: memory bandwidth from a
copy larger than the last-level cache (STREAM's convention: bytes read + bytes written per
second) and the arithmetic peak (`peak_rates`: a tight loop of independent multiply-adds on
every thread, kernels/csrc/peak_ops.c, at the widest instruction the loaded C variant has:
fp32 FMA, and the int16 / int8 dot products the quantized GEMMs use), plus torch's fp32 matmul
rate for reference (our GEMMs beat it, so it is no ceiling: dividing by it gave 134%).
`decode_roofline` loads the model into an `LLMEngine`, prefills `batch` prompts, times decode
steps (schedule + forward + sample, as the decode worker runs them) and compares the median
step with the larger of bytes moved / bandwidth and FLOPs / fp32 peak, both computed from
the model config (`step_cost`). `kv_handoff` moves one prompt's blocks between two pools with
the real `KVSender`/`KVReceiver` (shm: straight into the destination's shared pool; tcp: frames
over loopback) until the receiver has them in place, and compares with a plain copy of the
same bytes between the same pools.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.timing import median_seconds


@dataclass
class MachineRates:
    threads: int
    copy_gbps: float  # GB/s of memory traffic in a large copy: read + written bytes (STREAM "Copy")
    matmul_gflops: float  # fp32 torch.mm (MKL), for reference
    peak_gflops: float  # fp32 FMA peak (the compute ceiling); torch.mm's rate where the C kernels are off
    int16_gops: float | None = None  # int16 dot-product peak (2 operations per product); None without the C kernels
    int8_gops: float | None = None  # int8 dot-product peak
    peak_source: str = ""  # how peak_gflops was had


def peak_rates(threads: int, seconds: float = 0.2, repeats: int = 3) -> tuple[dict[str, float], str] | None:
    """kind (fp32, int16, int8) -> G operations / s of kernels/csrc/peak_ops.c's multiply-add loop
    on `threads` threads (the best of `repeats` runs of about `seconds` each, timed by the longest
    thread's own CPU time: the hardware's rate even where others share the machine), and the
    variant that ran it; None without the C kernels."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    if ops is None:
        return None
    rates = {}
    for kind in cpu_native.PEAK_KINDS:
        iters = 1 << 14
        while (took := ops.peak_ops(kind, iters, threads)[1]) < seconds / 10:  # grow the loop to a tenth of `seconds` ...
            iters *= 4
        iters = max(1, int(iters * seconds / max(took, 1e-9)))  # ... then size it to `seconds`
        rates[kind] = max(done / max(cpu_s, 1e-9) for done, cpu_s in (ops.peak_ops(kind, iters, threads) for _ in range(repeats))) / 1e9
    return rates, ops.isa


def machine_rates(threads: int, copy_mib: int = 512, matmul_n: int = 1536, repeats: int = 5, peak_s: float = 0.2) -> MachineRates:
    torch.set_num_threads(threads)
    n = copy_mib * 2**20 // 4
    src, dst = torch.rand(n), torch.empty(n)
    copy_s = median_seconds(lambda: dst.copy_(src), repeats, warmup=1)  # noqa: F821 (called before the del below)
    del src, dst
    a, b = torch.rand(matmul_n, matmul_n), torch.rand(matmul_n, matmul_n)
    mm_s = median_seconds(lambda: torch.mm(a, b), repeats, warmup=1)
    mm = 2 * matmul_n**3 / mm_s / 1e9
    peaks = peak_rates(threads, peak_s)
    if peaks is None:
        return MachineRates(threads, 2 * n * 4 / copy_s / 1e9, mm, mm, peak_source="torch.mm (no C kernels: no peak loop)")
    rates, isa = peaks
    return MachineRates(threads, 2 * n * 4 / copy_s / 1e9, mm, rates["fp32"], rates["int16"], rates["int8"],
                        f"FMA loop, {isa} variant, thread CPU time")


# ------------------------------------------------------------------ decode step

@dataclass
class StepCost:
    bytes: float
    flops: float


def linear_params(cfg) -> int:
    """Weights every decode token multiplies through: the layers' projections and the LM head."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def step_cost(cfg, batch: int, context: float, dtype_bytes: int = 4) -> StepCost:
    """One decode step of `batch` sequences with `context` tokens each (already cached).

    bytes: every weight once + each sequence's K and V read + the new K, V written.
    flops: 2 per weight per token, plus attention (q.k and p.v: 2 * 2 * heads * head_dim * context).
    """
    w = linear_params(cfg)
    kv_token = 2 * cfg.num_layers * cfg.kv_size * dtype_bytes
    nbytes = w * dtype_bytes + batch * (context + 1) * kv_token
    flops = 2 * batch * w + batch * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * context
    return StepCost(nbytes, flops)


@dataclass
class Roofline:
    batch: int
    context: float
    step_s: float
    cost: StepCost
    rates: MachineRates

    @property
    def memory_s(self) -> float:
        return self.cost.bytes / (self.rates.copy_gbps * 1e9)

    @property
    def compute_s(self) -> float:
        return self.cost.flops / (self.rates.peak_gflops * 1e9)

    @property
    def bound_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def fraction(self) -> float:
        return self.bound_s / self.step_s


def decode_step_seconds(engine, batch: int, prompt_len: int, steps: int, warmup: int = 3) -> tuple[float, float]:
    """Median seconds of one engine step with `batch` sequences decoding, and their mean context."""
    from pdserve_client.params import SamplingParams

    rng = random.Random(0)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request([rng.randrange(10, vocab - 10) for _ in range(prompt_len)], params, request_id=f"roofline-{i}")
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.seqs.values()):
        engine.step()  # prefill (chunked if the token budget is short)
    step_s = median_seconds(engine.step, steps, warmup)
    for rid in list(engine.seqs):
        engine.abort(rid)
    context = prompt_len + 1 + warmup + (steps - 1) / 2
    return step_s, context


def decode_roofline(model: str | None, threads: int, batch: int = 32, prompt_len: int = 128, steps: int = 16,
                    rates: MachineRates | None = None) -> Roofline:
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine

    torch.set_num_threads(threads)
    rates = rates or machine_rates(threads)
    blocks = batch * (-(-(prompt_len + steps + 8) // 16) + 1)
    cfg = EngineConfig(dtype="float32", quantization="none", num_blocks=blocks, max_num_seqs=max(64, batch),
                       max_num_batched_tokens=max(2048, batch * prompt_len))  # the float32 roofline
    engine = LLMEngine.load(model, cfg, progress=False, tokenizer=False)
    step_s, context = decode_step_seconds(engine, batch, prompt_len, steps)
    return Roofline(batch, context, step_s, step_cost(engine.cfg, batch, context), rates)


def format_roofline(r: Roofline) -> str:
    m = r.rates
    return "\n".join([
        f"{' Decode step roofline ':=^56}",
        f"{'Threads (decode worker share):':<44} {m.threads}",
        f"{'Memory bandwidth, copy read+write (GB/s):':<44} {m.copy_gbps:.1f}",
        f"{'fp32 peak, FMA loop (GFLOP/s):':<44} {m.peak_gflops:.1f} ({m.peak_source})",
        f"{'int16 / int8 dot-product peak (GOP/s):':<44} " + (f"{m.int16_gops:.1f} / {m.int8_gops:.1f}" if m.int16_gops else "n/a"),
        f"{'fp32 torch.mm, for reference (GFLOP/s):':<44} {m.matmul_gflops:.1f}",
        f"{'Batch x mean context (tokens):':<44} {r.batch} x {r.context:.0f}",
        f"{'Bytes moved per step (MB):':<44} {r.cost.bytes / 1e6:.1f}",
        f"{'FLOPs per step (GFLOP):':<44} {r.cost.flops / 1e9:.2f}",
        f"{'Memory bound / compute bound (ms):':<44} {r.memory_s * 1e3:.1f} / {r.compute_s * 1e3:.1f}",
        f"{'Same FLOPs at the int16 / int8 peak (ms):':<44} "
        + (f"{r.cost.flops / m.int16_gops / 1e6:.1f} / {r.cost.flops / m.int8_gops / 1e6:.1f} (the quantized path's integer products)"
           if m.int16_gops else "n/a"),
        f"{'Measured step, median (ms):':<44} {r.step_s * 1e3:.1f}",
        f"{'Fraction of roofline:':<44} {r.fraction:.1%} (goal >= 60%: {'met' if r.fraction >= 0.6 else 'MISSED'})",
        f"{'Decode throughput at this batch (tok/s):':<44} {r.batch / r.step_s:.0f}",
        "=" * 56,
    ])


# ------------------------------------------------------------------ KV hand-off

@dataclass
class Handoff:
    backend: str
    tokens: int
    nbytes: int
    seconds: float  # median, send to "in place at the receiver"
    memcpy_seconds: float  # the same bytes, one contiguous copy between the same pools

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def memcpy_gbps(self) -> float:
        return self.nbytes / self.memcpy_seconds / 1e9


def _handoff_once(sender, receiver, src, dst_pool, shape, backend: str, n_blocks: int, rng: random.Random, tag: str) -> float:
    from pdserve.wire.protocol import KVReady
    from pdserve_client.params import SamplingParams

    num_blocks = shape[2]
    src_ids, dst_ids = rng.sample(range(num_blocks), n_blocks), rng.sample(range(num_blocks), n_blocks)
    msg = KVReady(tag, [1], [2], SamplingParams(), dst_ids, n_blocks * shape[3], "")
    t0 = time.perf_counter()
    sender.send(src, src_ids, msg, receiver.endpoint)
    got = receiver.recv()
    receiver.copy_in(*got)
    seconds = time.perf_counter() - t0
    # dst, src: (layers, 2, num_blocks, block_size, KVH, D)
    if not torch.equal(dst_pool.tensor[:, :, dst_ids], src[:, :, src_ids]):
        raise AssertionError(f"{backend} hand-off delivered wrong bytes")
    return seconds


def kv_handoff(cfg, tokens: int, threads: int, block_size: int = 16, repeats: int = 20, backends=("shm", "tcp")) -> list[Handoff]:
    """Median hand-off time of one `tokens`-token prompt's blocks, per backend, with random block ids."""
    import threading

    import zmq

    from pdserve.kvtransfer.pool import KVPool
    from pdserve.kvtransfer.transfer import KVReceiver, KVSender
    from pdserve.runtime.kv_cache import kv_cache_shape

    torch.set_num_threads(threads)
    n_blocks = -(-tokens // block_size)
    shape = kv_cache_shape(cfg, max(4 * n_blocks, 64), block_size)
    src = torch.rand(shape)
    dst_pool = KVPool.create(shape, torch.float32, shared=True)
    ctx = zmq.Context()
    receiver = KVReceiver(ctx, dst_pool.tensor, shm_path=dst_pool.path)
    senders = {b: KVSender(ctx, f"bench-{b}", backend=b) for b in {"shm", *backends}}
    rng = random.Random(0)
    nbytes = n_blocks * src[:, :, 0].numel() * src.element_size()
    flat_src, flat_dst = src.view(-1)[: nbytes // 4], dst_pool.tensor.view(-1)[: nbytes // 4]
    try:
        for sender in senders.values():  # each asks the receiver for its pool once (answered here, on another thread)
            answer = threading.Thread(target=lambda: receiver.sock.poll(10_000) and receiver.recv())
            answer.start()
            sender.destination(receiver.endpoint, src)
            answer.join()
        _handoff_once(senders["shm"], receiver, src, dst_pool, shape, "shm", n_blocks, rng, "attach")
        for pool in (dst_pool, *senders["shm"].pools.values()):
            pool.tensor.zero_()  # fault every page into both mappings, as in a worker that has run a while
        memcpy_s = median_seconds(lambda: flat_dst.copy_(flat_src), repeats, warmup=1)
        out = []
        for backend in backends:
            times = [_handoff_once(senders[backend], receiver, src, dst_pool, shape, backend, n_blocks, rng, f"{backend}-{i}")
                     for i in range(repeats + 1)]
            out.append(Handoff(backend, tokens, nbytes, statistics.median(times[1:]), memcpy_s))
        return out
    finally:
        for sender in senders.values():
            sender.close()
        receiver.close()
        ctx.destroy(linger=0)
        dst_pool.close()


def format_handoffs(rows: list[Handoff], threads: int) -> str:
    lines = [f"{' KV hand-off (one prompt, random block ids) ':=^72}",
             f"{'backend':8s} {'tokens':>7s} {'MB':>7s} {'ms':>8s} {'GB/s':>7s} {'memcpy GB/s':>12s} {'of memcpy':>10s}"]
    for h in rows:
        frac = h.gbps / h.memcpy_gbps
        goal = "" if h.backend != "shm" else ("  goal >= 50%: met" if frac >= 0.5 else "  goal >= 50%: MISSED")
        lines.append(f"{h.backend:8s} {h.tokens:7d} {h.nbytes / 1e6:7.2f} {h.seconds * 1e3:8.3f} {h.gbps:7.2f} {h.memcpy_gbps:12.2f} "
                     f"{frac:9.0%}{goal}")
    lines.append(f"(memcpy: one contiguous copy of the same bytes between the same two pools; {threads} torch thread(s))")
    lines.append("=" * 72)
    return "\n".join(lines)
