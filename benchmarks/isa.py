#!/usr/bin/env python
"""The C kernels' instruction-set variants side by side (kernels/native_build.py: baseline, avx2,
avx512), against oneDNN and MKL, on the default model's GEMM shapes (hidden 576, intermediate
1536, vocab 49152), in one process with the back-ends alternating call by call so that a shared
machine's noise lands on all of them alike; medians of --repeats rounds, milliseconds.

- fp32 decode GEMM (`pd_f_matmul`, float32 weights read in place) at --decode-rows rows (a
  batch-32 decode step) against oneDNN packed fp32 (what PackedLinear's onednn kind runs) and
  F.linear (MKL);
- quantized GEMM (`pd_q_matmul`, Q4_1 weights, int16 activations: the engine's default) at
  --prompt-rows rows (prefill chunks) against dequantised weights through F.linear (MKL) and oneDNN;
- the int8-activation VNNI GEMM (back-end c-int8-vnni) against c-int16 and dequant-mkl at the
  same rows, with the default model's weight types, and which of them kernels.select picks.
The `step` line sums 30 layers and the LM head.

Usage: .venv/bin/python -m benchmarks.isa [--threads 2] [--repeats 15] [--isas avx2,avx512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native
from pdserve.kernels.quant import QTYPES, QuantTensor

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}  # (N, K)
PER_STEP = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "lm_head": 1}


CLOCK = [time.perf_counter]


def parse_timed(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with --cpu-time added to `ap` and applied (CLOCK), and --threads (which `ap`
    defines) set on torch."""
    ap.add_argument("--cpu-time", action="store_true", help="time by the process's CPU time, not the wall clock: with --threads 1 "
                    "this leaves out the time other processes of a shared machine held the core")
    args = ap.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.process_time
    torch.set_num_threads(args.threads)
    return args


def alternate(fns: dict, repeats: int) -> dict:
    """Median milliseconds of each callable, called round-robin `repeats` times after one warm-up."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = CLOCK[0]()
            fn()
            times[name].append((CLOCK[0]() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def random_quant(n: int, k: int, g: torch.Generator, qtype: str = "Q4_1") -> QuantTensor:
    """Random blocks of `qtype`: fp16 scales (and Q4_1 offsets) in +-0.01, random code bytes."""
    nb, bb = k // 32, QTYPES[qtype][1]
    heads = 2 if qtype == "Q4_1" else 1
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=g)
    dm = (torch.rand(n, nb, heads, generator=g) * 0.02 - 0.01).half().view(torch.uint8).view(n, nb, 2 * heads)
    raw[..., :2 * heads] = dm
    return QuantTensor(raw.view(n, nb * bb).contiguous(), qtype, (n, k))


def int8_prompt(rows_list: list[int], repeats: int) -> None:
    """The default model's shapes and weight types (Q4_1 layers, Q8_0 LM head) at prompt row
    counts: the int16 GEMM (c-int16) against the int8 VNNI one (c-int8-vnni) and dequantise +
    MKL, as kernels.select binds them; medians (ms) and the selector's pick among the three
    (kernels.select.choose: twin check, then the minimum of a few calls each)."""
    from pdserve.kernels import backends, select

    g = torch.Generator().manual_seed(0)
    names = ("c-int16", "c-int8-vnni", "dequant-mkl")
    for rows in rows_list:
        results = {}
        for layer, (n, k) in SHAPES.items():
            w, x = random_quant(n, k, g, "Q8_0" if layer == "lm_head" else "Q4_1"), torch.randn(rows, k, generator=g)
            runs = {name: backends.BY_NAME[name].bind(w) for name in names}
            results[layer] = alternate({name: (lambda f: lambda: f(x))(run) for name, run in runs.items() if run is not None}, repeats)
            key = select.shape_key(w)
            table = select.choose({key: w}, {key: [rows]}, {key: tuple(backends.BY_NAME[n] for n in names)}, lambda k, r: "c-int16")
            results[layer]["selector"] = table.entries[key][0][1]
        print(f"\nquantized prompt GEMM, {rows} rows (ms)\n{'layer':10s}" + "".join(f"{n:>14s}" for n in results["qkv"]))
        for layer, row in results.items():
            print(f"{layer:10s}" + "".join(f"{v:14.3f}" if isinstance(v, float) else f"{v:>14s}" for v in row.values()))


def onednn(w: torch.Tensor, rows: int):
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def report(title: str, results: dict) -> None:
    names = list(next(iter(results.values())))
    print(f"\n{title}\n{'layer':10s}" + "".join(f"{n:>14s}" for n in names))
    step = {n: 0.0 for n in names}
    for layer, row in results.items():
        print(f"{layer:10s}" + "".join(f"{row[n]:14.3f}" for n in names))
        for n in names:
            step[n] += row[n] * PER_STEP[layer]
    print(f"{'step':10s}" + "".join(f"{step[n]:14.1f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--prompt-rows", default="128,512")
    ap.add_argument("--isas", default=None, help="comma-separated variants (default: every one this machine runs)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: decode, prompt, int8")
    args = parse_timed(ap)
    isas = args.isas.split(",") if args.isas else [i for i in cpu_native.usable_isas() if i != "baseline"]
    ops = {isa: cpu_native.load(isa) for isa in isas}
    print(f"variants {isas}; CPU features {sorted(cpu_native.cpu_features())}; {args.threads} threads; medians of {args.repeats}")
    g = torch.Generator().manual_seed(0)
    if "decode" not in args.skip:
        results = {}
        for layer, (n, k) in SHAPES.items():
            w, x = torch.randn(n, k, generator=g), torch.randn(args.decode_rows, k, generator=g)
            fns = {f"C {isa}": (lambda f: lambda: f(x))(op.f_linear(w)) for isa, op in ops.items()}
            fns.update({"oneDNN packed": (lambda f: lambda: f(x))(onednn(w, args.decode_rows)), "F.linear": lambda: F.linear(x, w)})
            results[layer] = alternate(fns, args.repeats)
        report(f"fp32 decode GEMM, {args.decode_rows} rows (ms)", results)
    if "prompt" not in args.skip:
        for rows in map(int, args.prompt_rows.split(",")):
            results = {}
            for layer, (n, k) in SHAPES.items():
                if layer == "lm_head":
                    continue  # a prompt takes the LM head at its last rows only
                w, x = random_quant(n, k, g), torch.randn(rows, k, generator=g)
                wf = w.dequantize()
                fns = {f"C {isa} i16": (lambda f: lambda: f(x))(op.q_linear(w, "int16")) for isa, op in ops.items()}
                fns.update({"deq+F.linear": lambda: F.linear(x, wf), "deq+oneDNN": (lambda f: lambda: f(x))(onednn(wf, rows))})
                results[layer] = alternate(fns, args.repeats)
            report(f"Q4_1 prompt GEMM, {rows} rows (ms; the F.linear / oneDNN columns exclude dequantising)", results)
    if "int8" not in args.skip:
        int8_prompt(list(map(int, args.prompt_rows.split(","))), args.repeats)


if __name__ == "__main__":
    main()
