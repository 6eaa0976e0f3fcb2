"""`python -m benchmarks.lone_step`: where a lone stream's decode step goes, part by part.

Lifecycle: one run in this process. Loads the default model (or --model) into an `LLMEngine` as
the decode worker runs it (weights as the GGUF ships them, `--linear-backend auto`, int16
activations, --threads torch threads), prefills one --prompt-len prompt and then times decode
steps of that one sequence three ways:
- the whole `engine.step()` (schedule + prepare + forward + sample + postprocess), and each of
  its Python-visible parts by timing wrappers around them (runner.prepare, the embedding, the
  one-call C layer step `decode_layers`, the final norm, the LM head, the sampler): what is left
  of the step is the scheduler, the engine's bookkeeping and the detokenizer;
- the C layer step split by kernel: every layer's four projections called alone through ctypes
  in the step's order (so that the weights stream from memory as in the step), the paged
  attention, and the norms / rope / silu; each kernel's weight bytes over its time is the
  memory rate it reaches, against this machine's copy bandwidth (benchmarks.roofline);
- the LM head at one row, alone.
`--quantization none`: the same model dequantized to float (the per-layer loop of
runtime.layer; no kernel split). Prints a table in ms per step. Timings on a shared machine are indicative: run it alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.timing import median_seconds


class Timed:
    """A callable wrapper that adds each call's wall time to `total` (seconds) and counts calls."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1


def build_engine(model, threads: int, prompt_len: int, quantization: str = "auto"):
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.load(model, EngineConfig(linear_backend="auto", quant_activations="int16", quantization=quantization), progress=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 20000, (prompt_len,), generator=gen).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt
    return engine


def step_times(engine, steps: int) -> list[float]:
    """Seconds of each of `steps` engine steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def time_steps(engine, steps: int) -> dict[str, float]:
    """Median ms of engine.step() and the mean ms per step of each wrapped part."""
    import pdserve.runtime.model_runner as mr

    fast, runner = engine.model.fast, engine.runner
    parts = {"prepare": Timed(runner.prepare), "embed": Timed(fast.embed), "decode_layers (C)": Timed(fast.ops.decode_layers),
             "lm head": Timed(fast.lm_head.__call__), "sample": Timed(mr.sample), "rms_norm (first + final)": Timed(fast.ops.rms_norm)}
    saved = (runner.prepare, fast.embed, fast.ops.decode_layers, fast.lm_head, mr.sample, fast.ops.rms_norm)
    runner.prepare, fast.embed, fast.ops.decode_layers, mr.sample, fast.ops.rms_norm = (
        parts["prepare"], parts["embed"], parts["decode_layers (C)"], parts["sample"], parts["rms_norm (first + final)"])
    fast.lm_head = parts["lm head"]
    try:
        for _ in range(5):
            engine.step()
        for p in parts.values():
            p.total, p.calls = 0.0, 0
        times = step_times(engine, steps)
    finally:
        runner.prepare, fast.embed, fast.ops.decode_layers, fast.lm_head, mr.sample, fast.ops.rms_norm = saved
        del fast.ops.decode_layers, fast.ops.rms_norm  # the instance attributes: back to the class's methods
    out = {"engine.step (median)": statistics.median(times) * 1e3, "engine.step (mean)": statistics.mean(times) * 1e3}
    layers = fast.step_layers.array if fast.step_layers is not None else []
    saved16 = [(slot, name, getattr(slot, name).w16) for slot in layers for name in ("qkv", "o", "gate_up", "down")]
    if any(w16 for _, _, w16 in saved16):  # the same steps without the 16-row GEMV in the layers (pd_q_matmul's int16 path)
        for slot, name, _ in saved16:
            getattr(slot, name).w16 = None
        try:
            off = step_times(engine, steps)
        finally:
            for slot, name, w16 in saved16:
                getattr(slot, name).w16 = w16
        out["engine.step (median), layers without gemv16"] = statistics.median(off) * 1e3
    for name, p in parts.items():
        out[name] = p.total / steps * 1e3
    out["rms_norm calls per step"] = parts["rms_norm (first + final)"].calls / steps
    return out


def kernel_split(engine, repeats: int) -> dict[str, float]:
    """ms per step of the C layer step's kernels, each kind called alone in the step's order."""
    fast, lib = engine.model.fast, engine.model.fast.ops.lib
    c = fast.cfg
    x = torch.randn(1, max(c.hidden_size, c.intermediate_size))
    out = torch.empty(1, 2 * c.intermediate_size + c.q_size)
    act = 2  # int16
    lins = {name: [getattr(layer, name).weight for layer in fast.layers] for name in ("qkv", "o", "gate_up", "down")}
    seq = next(iter(engine.seqs.values()))
    res = {}

    def run_linears(names, same_layer=False):
        for i in range(len(fast.layers)):
            for n in names:
                w = lins[n][0 if same_layer else i]
                lib.pd_q_matmul(x.data_ptr(), x.shape[1], w.raw.data_ptr(), w.raw.stride(0), w.type_id, 1, w.shape[0], w.shape[1],
                                out.data_ptr(), out.shape[1], act)

    def best(fn):  # median ms
        return median_seconds(fn, repeats, warmup=1) * 1e3

    bytes_all = sum(w.nbytes for ws in lins.values() for w in ws)
    res["linears, all 4 x layers, step order (pd_q_matmul)"] = t_all = best(lambda: run_linears(("qkv", "o", "gate_up", "down")))
    res["  weight MB read"] = bytes_all / 1e6
    res["  GB/s"] = bytes_all / t_all / 1e6
    if fast.ops.has_gemv16:
        copies = {n: [fast.ops.gemv16_copy(w) for w in ws] for n, ws in lins.items()}

        def run_gemv16():
            for i in range(len(fast.layers)):
                for n in ("qkv", "o", "gate_up", "down"):
                    w = lins[n][i]
                    lib.pd_q_gemv16(x.data_ptr(), x.shape[1], copies[n][i].data_ptr(), w.type_id, 1, w.shape[0], w.shape[1],
                                    out.data_ptr(), out.shape[1])

        res["linears, all 4 x layers, step order (pd_q_gemv16)"] = t16 = best(run_gemv16)
        res["  GB/s "] = bytes_all / t16 / 1e6
    for n in lins:
        res[f"  {n} (30 layers, alone)"] = best(lambda n=n: run_linears((n,)))
    res["linears, layer 0's weights 30 times (cache-resident)"] = best(lambda: run_linears(("qkv", "o", "gate_up", "down"), True))
    big = torch.ones(64 << 20)  # 256 MB, past the last-level cache
    res["memory read GB/s (torch sum over 256 MB)"] = big.numel() * 4 / best(big.sum) / 1e6
    del big
    noop = best(lambda: [lib.pd_build_isa() for _ in range(4 * len(fast.layers))])
    res["  ctypes cost of 120 calls (no-op)"] = noop
    # attention at this sequence's length, every layer
    kv = engine.runner.kv_cache
    qkv = torch.randn(1, c.q_size + 2 * c.kv_size)
    attn = torch.empty(1, c.q_size)
    rows = torch.zeros(1, dtype=torch.int64)
    table = torch.tensor([seq.block_table], dtype=torch.int32)
    lens = torch.tensor([seq.num_computed_tokens], dtype=torch.int32)
    _, _, _, bs, kvh, d = kv.shape

    def attention():
        for i in range(len(fast.layers)):
            k, v = kv[i, 0], kv[i, 1]
            lib.pd_paged_decode_attention(qkv.data_ptr(), qkv.shape[1], attn.data_ptr(), attn.shape[1], rows.data_ptr(), k.data_ptr(),
                                          v.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(), 1, c.num_heads, kvh, d, bs,
                                          fast.scale, 0)

    res[f"attention (30 layers, {seq.num_computed_tokens} tokens)"] = best(attention)
    h, xo = torch.randn(1, c.hidden_size), torch.empty(1, c.hidden_size)
    gu, a = torch.randn(1, 2 * c.intermediate_size), torch.empty(1, c.intermediate_size)
    w = fast.layers[0].attn_norm

    def small():
        for _ in range(len(fast.layers)):
            for _ in range(2):
                lib.pd_rms_norm(xo.data_ptr(), c.hidden_size, h.data_ptr(), w.data_ptr(), xo.data_ptr(), 1, c.hidden_size, fast.eps)
            lib.pd_silu_mul(gu.data_ptr(), a.data_ptr(), 1, c.intermediate_size)

    res["norms + silu (30 layers, incl. 90 ctypes calls)"] = best(small)
    res["  ctypes cost of 90 calls (no-op)"] = best(lambda: [lib.pd_build_isa() for _ in range(3 * len(fast.layers))])
    head = fast.lm_head.weight
    last = torch.randn(1, c.hidden_size)
    res[f"lm head alone ({'x'.join(map(str, head.shape))}, {head.qtype if hasattr(head, 'qtype') else head.dtype}, {head.nbytes / 1e6:.1f} MB)"] = \
        best(lambda: fast.lm_head(last))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.lone_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quantization", choices=("auto", "none"), default="auto",
                    help="none: the weights dequantized to float (the per-layer loop; the kernel split is skipped)")
    args = ap.parse_args(argv)
    engine = build_engine(args.model, args.threads, args.prompt_len, args.quantization)
    table = engine.model.fast.linear_table
    at1 = {shape: rows[0][1] for shape, rows in table.entries.items()} if table is not None else "rules"
    print(f"threads {args.threads}; isa {engine.model.fast.ops.isa}; back-end at 1 row: {at1}")
    split = kernel_split(engine, args.repeats) if engine.model.quantized else {}
    for name, v in {**time_steps(engine, args.steps), **split}.items():
        print(f"{name:60s} {v:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
