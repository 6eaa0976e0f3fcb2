"""The weight-only quantized matmul as a Triton kernel: y = x @ W^T with W in GGUF's Q4_0 / Q4_1 /
Q8_0 blocks (kernels.quant.QuantTensor; kernels.quant.TRITON_QTYPES: Q5_0 / Q5_1 and the K-quants
are dequantized at load on CUDA by runtime.build.build_model, with a log line), for CUDA; on CPU tensors it runs under TRITON_INTERPRET=1
(how the tests check it where no GPU is lent).

Lifecycle: imported lazily by kernels.quant.matmul_triton the first time a quantized linear layer
runs on a CUDA device (or in a test under the interpreter); the kernel compiles once per
(type, dtype, tile) and Triton caches it. One program computes a (BLOCK_M x BLOCK_N) tile of y:
for each 32-weight block along K it reads the block's scale (and minimum) and its 16 or 32 code
bytes for BLOCK_N weight rows straight from the file's bytes, dequantizes them in registers to
the activation dtype (w = d * q + m, with m = -8 d for Q4_0 and 0 for Q8_0) and adds two
16-wide tl.dot products (weights 0..15 and 16..31 of the block) into a float32 accumulator. The
weights are never materialized in float: the kernel streams the quantized bytes, which is what
makes a decode step memory-light. Its twin is kernels.quant.matmul_twin (dequantize, F.linear).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels.quant import QTYPES, TRITON_QTYPES, QuantTensor

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _half_at(p, mask):
    """The little-endian fp16 at byte address p (BLOCK_N,), as float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _qmm_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, M, N, NB, stride_xm, stride_om, row_bytes,
                QT: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    j = tl.arange(0, 16)
    rows = w_ptr + rn.to(tl.int64) * row_bytes  # (BLOCK_N,) each weight row's first block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, NB):
        blk = rows + b * BB
        d = _half_at(blk, n_ok)
        if QT == 3:  # Q4_1: d, m, 16 bytes of nibbles
            m = _half_at(blk + 2, n_ok)
            raw = tl.load((blk + 4)[:, None] + j[None, :], mask=n_ok[:, None], other=0)
            c0, c1 = (raw & 15).to(tl.float32), (raw >> 4).to(tl.float32)
        elif QT == 2:  # Q4_0: d, 16 bytes of nibbles, w = d * (q - 8)
            m = -8.0 * d
            raw = tl.load((blk + 2)[:, None] + j[None, :], mask=n_ok[:, None], other=0)
            c0, c1 = (raw & 15).to(tl.float32), (raw >> 4).to(tl.float32)
        else:  # Q8_0: d, 32 signed bytes
            m = 0.0 * d
            c0 = tl.load((blk + 2)[:, None] + j[None, :], mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
            c1 = tl.load((blk + 18)[:, None] + j[None, :], mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
        x0 = tl.load(x_ptr + rm[:, None] * stride_xm + b * 32 + j[None, :], mask=m_ok[:, None], other=0.0)
        x1 = tl.load(x_ptr + rm[:, None] * stride_xm + b * 32 + 16 + j[None, :], mask=m_ok[:, None], other=0.0)
        w0 = (d[:, None] * c0 + m[:, None]).to(x0.dtype)  # (BLOCK_N, 16): weights 0..15 of the block
        w1 = (d[:, None] * c1 + m[:, None]).to(x0.dtype)  # 16..31 (high nibbles, or bytes 16..31)
        acc += tl.dot(x0, tl.trans(w0), input_precision=DOT_PRECISION)
        acc += tl.dot(x1, tl.trans(w1), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) (float32, bfloat16 or float16, rows contiguous) @ w^T (+ bias), in x's dtype; x
    and w.raw on one CUDA device (or on the CPU under TRITON_INTERPRET=1)."""
    M, K = x.shape
    N = w.shape[0]
    if w.qtype not in TRITON_QTYPES:
        raise ValueError(f"triton quant matmul: {w.qtype} is not a type this kernel takes ({', '.join(TRITON_QTYPES)}); "
                         "runtime.engine dequantizes the others at load on CUDA")
    if K != w.shape[1] or x.stride(1) != 1:
        raise ValueError(f"triton quant matmul: x must be (M, {w.shape[1]}) with contiguous rows, got {tuple(x.shape)}")
    if x.device != w.raw.device or (x.device.type != "cuda" and not _INTERPRETED):
        raise ValueError(f"triton quant matmul: x on {x.device} and the weight on {w.raw.device} must share a CUDA device")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m = 16 if M <= 16 else 32
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    # float32 activations: exact products as the float twin (ieee); half types: the tensor cores
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _qmm_kernel[grid](x, w.raw, out, bias if bias is not None else out, M, N, K // 32, x.stride(0), out.stride(0), w.raw.stride(0),
                      QT=w.type_id, BB=QTYPES[w.qtype][1], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                      DOT_PRECISION=precision)
    return out
