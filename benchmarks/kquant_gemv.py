"""Benchmark: the lone stream's quantized GEMV (one row of activations) at 1B Llama-3 shapes, Q4_0
against the K-quants (Q4_K, Q5_K, Q6_K) served from their blocks and the dequantized float32 matrix.

Lifecycle: run by hand from the repository root (`.venv/bin/python -m benchmarks.kquant_gemv
[--threads N] [--runs N] [--activations int16|float]`); builds random blocks of each type
(tests.helpers.quant_blocks) for (out, in) = 2048x2048, 8192x2048 (gate/up), 2048x8192 (down)
and 49152x2048 (a vocab-sized head: 2048 wide, 49152 rows), times one row through the bound C
kernel (kernels.cpu_native q_linear, the engine's path; int16 activations by default) and
through F.linear on the float32 matrix, and prints the median of `--runs` in microseconds, GB/s
of weight bytes read, and each type's time per weight byte against Q4_0's. Prints, never asserts:
on a machine shared with other jobs the figures are noisy (rerun, compare medians).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.machine import cpu_line
from benchmarks.timing import median_seconds
from pdserve.kernels import cpu_native
from tests.helpers import quant_blocks

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (49152, 2048)]  # (out rows, in) of the weight
TYPES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K")


def median_us(fn, runs: int) -> float:
    return median_seconds(fn, runs, warmup=2) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--activations", default="int16", choices=("int16", "int8", "float"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_native.native()
    if ops is None:
        raise SystemExit("the C kernels are not built here")
    print(cpu_line())
    print(f"variant {ops.isa}, {args.threads} thread(s), {args.activations} activations, one row, median of {args.runs}")
    print(f"{'shape (out x in)':>18} {'type':>6} {'MiB':>7} {'us':>9} {'GB/s':>6} {'per byte vs Q4_0':>17}")
    for n, k in SHAPES:
        x = torch.randn(1, k)
        q4_0 = None
        for qtype in TYPES:
            w = quant_blocks(qtype, n, k, seed=1)
            run = ops.q_linear(w, args.activations)
            out = torch.empty(1, n)
            us = median_us(lambda: run(x, out), args.runs)
            per_byte = us / w.nbytes
            q4_0 = per_byte if qtype == "Q4_0" else q4_0
            print(f"{n:>8} x {k:<7} {qtype:>6} {w.nbytes / 2**20:7.1f} {us:9.0f} {w.nbytes / us / 1e3:6.1f} {per_byte / q4_0:16.2f}x")

        wf = torch.randn(n, k)
        us = median_us(lambda: F.linear(x, wf), args.runs)
        print(f"{n:>8} x {k:<7} {'f32':>6} {wf.numel() * 4 / 2**20:7.1f} {us:9.0f} {wf.numel() * 4 / us / 1e3:6.1f} {'':>17}")



if __name__ == "__main__":
    main()
