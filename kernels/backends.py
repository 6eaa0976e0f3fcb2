"""The ways this process can multiply y = x @ W^T on the CPU, each with its twin and tolerance.

Lifecycle: a `Backend` is a constant of this module (`FLOAT` for float32 weights, `QUANT` for
kernels.quant.QuantTensor weights); `bind(weight)` is called once per weight (kernels.linear
PackedLinear, or kernels.select while timing) and returns a callable `run(x, out=None) -> y`
for at most `max_rows` rows, or None where the back-end cannot run here (no C kernels, no native
bf16, a weight type it does not take). Whatever `bind` keeps (a packed copy) lives as long as
the callable. `twin(x, weight)` is the slow, obvious float64 product the back-end must agree
with, within `tol` of the row's magnitude (kernels.select.disagreement). Back-ends whose
`precision` is not "exact" round the weights or the activations and are only chosen where the
model-level teacher-forced check (runtime/linear_plan.py) passes.

Names, as `--linear-backend` takes them:
- `c`: the C tiled kernel (kernels/csrc/quant_ops.c pd_f_matmul) reading float32 W in place;
- `onednn`: W reordered once into oneDNN's blocked layout, `mkldnn._linear_pointwise` (vLLM's CPU
  path); rows padded to few counts (`row_bucket`: oneDNN keeps a primitive per row count);
- `mkl`: `F.linear` (MKL's sgemm);
- `onednn-bf16`: oneDNN with W and x rounded to bfloat16, fp32 accumulation, only where the CPU
  computes bf16 natively (avx512_bf16 or amx_bf16 in /proc/cpuinfo);
- `int8pack`: `torch._weight_int8pack_mm`, W rounded to int8 per output channel;
- quantized weights: `c-float`, `c-int16`, `c-int8` (kernels.quant.bound_matmul, activations
  kept float or rounded per 32-wide block), `c-int8-vnni` (the int8 rounding at any row count,
  by the AVX-512 VNNI GEMM quant_ops.c pd_q_gemm_i8: binds only where the loaded C variant is
  avx512, so a CPU without VNNI never runs it), `dequant-mkl` (dequantize, then F.linear; what
  kernels.quant.matmul does above the C kernel's rows) and `int4pack`
  (`torch._weight_int4pack_mm_for_cpu`; Q4_0 / Q4_1 blocks map onto its groups exactly).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import quant

ANY_ROWS = quant.ANY_ROWS


@dataclass(frozen=True)
class Backend:
    name: str
    precision: str  # "exact" (float32 products, any summation order), "int16", "bf16", "int8"
    max_rows: int
    tol: float  # max |y - twin| allowed, as a share of max(|x| @ |W|^T) over the output
    bind: Callable  # weight -> run(x, out=None) | None
    twin: Callable  # (x, weight) -> float64 (M, N)


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN runs for `rows` rows: 1, 2, 4, 8, then multiples of 8 up to 128,
    then multiples of 64 (a bounded set of primitives per weight however long prompts are)."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8 if rows <= 128 else -(-rows // 64) * 64


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return frozenset()


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (else oneDNN emulates it, slowly)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _with_out(fn):
    """run(x, out=None) from y = fn(x); out is ignored (PackedLinear's contract: the result is
    returned, and only the C kernels write into a given buffer)."""

    def run(x, out=None):
        return fn(x)

    return run


def onednn_run(packed: torch.Tensor, dtype: torch.dtype = torch.float32):
    """x -> x @ W^T by oneDNN on a weight packed by `_reorder_linear_weight`, rows padded to row_bucket."""

    def fn(x):
        rows = x.shape[0]
        if rows == 0:
            return x.new_zeros((0, packed.size(0) if packed.dim() == 2 else 0))
        bucket = row_bucket(rows)
        if bucket != rows or x.dtype != dtype:
            padded = x.new_zeros((bucket, x.shape[1]), dtype=dtype)
            padded[:rows] = x
            x = padded
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return (y if bucket == rows else y[:rows]).float()

    return _with_out(fn)


def _native():
    from pdserve.kernels import cpu_native

    return cpu_native.native()


def _bind_c(w):
    ops = _native()
    return ops.f_linear(w) if ops is not None and w.is_contiguous() else None


def _bind_onednn(w):
    return onednn_run(torch.ops.mkldnn._reorder_linear_weight(w, 32)) if torch.backends.mkldnn.is_available() else None


def _bind_bf16(w):
    if not native_bf16():
        return None
    return onednn_run(torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 32), torch.bfloat16)


def _bind_mkl(w):
    return _with_out(lambda x: F.linear(x, w))


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W as int8 codes per output channel and their scales: w ~ codes * scale (rounded half to even)."""
    scale = (w.abs().amax(1) / 127).clamp_min(1e-30)
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _bind_int8pack(w):
    if not hasattr(torch, "_weight_int8pack_mm"):
        return None
    codes, scale = int8_weights(w)
    return _with_out(lambda x: torch._weight_int8pack_mm(x, codes, scale))


def _float_twin(x, w):
    return F.linear(x.double(), w.double())


def _int8pack_twin(x, w):
    codes, scale = int8_weights(w)
    return F.linear(x.double(), codes.double() * scale.double()[:, None])


def _bind_quant(activations: str):
    def bind(w):
        return quant.bound_matmul(w, activations)

    return bind


def _quant_twin(activations: str):
    if activations == "float":
        return lambda x, w: F.linear(x.double(), w.dequantize().double())
    return lambda x, w: quant.matmul_int_twin(x, w, activations)


def _bind_int8_gemm(w):
    ops = _native()
    return None if ops is None else ops.q_linear_i8_gemm(w)


def _bind_dequant(w):
    ops = _native()
    return _with_out(lambda x: F.linear(x, w.dequantize() if ops is None else ops.q_dequant(w)))


def int4_groups(w: quant.QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks as torch's int4 groups: codes (N, K) int32 in 0..15 and scales_and_zeros
    (K/32, N, 2) float32 with w = (q - 8) * scale + zero: scale = d, zero = m + 8d (Q4_1) or 0 (Q4_0)."""
    n, k = w.shape
    blocks = w.raw.reshape(n, k // quant.BLOCK, quant.QTYPES[w.qtype][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # (N, K/32)
    codes = blocks[..., 4:20] if w.qtype == "Q4_1" else blocks[..., 2:18]
    q = torch.cat([codes & 15, codes >> 4], dim=-1).reshape(n, k).to(torch.int32)
    zero = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1) + 8 * d if w.qtype == "Q4_1" else torch.zeros_like(d)
    return q, torch.stack([d.t(), zero.t()], -1).contiguous()


def _bind_int4pack(w):
    if w.qtype not in ("Q4_0", "Q4_1") or w.shape[0] % 16 or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):  # packs 16 rows at once
        return None
    q, scales_zeros = int4_groups(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return _with_out(lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, quant.BLOCK, scales_zeros))


EXACT_TOL = 2e-5  # float32 products in any order: a few ulps of the row's magnitude, K up to ~10^4

FLOAT = (
    Backend("c", "exact", ANY_ROWS, EXACT_TOL, _bind_c, _float_twin),
    Backend("onednn", "exact", ANY_ROWS, EXACT_TOL, _bind_onednn, _float_twin),
    Backend("mkl", "exact", ANY_ROWS, EXACT_TOL, _bind_mkl, _float_twin),
    # bf16 rounds each factor to 8 bits of mantissa (2^-9 relative each): products within ~4e-3
    Backend("onednn-bf16", "bf16", ANY_ROWS, 1e-2, _bind_bf16, _float_twin),
    Backend("int8pack", "int8", ANY_ROWS, EXACT_TOL, _bind_int8pack, _int8pack_twin),
)

QUANT = (
    Backend("c-float", "exact", quant.kernel_rows("float"), EXACT_TOL, _bind_quant("float"), _quant_twin("float")),
    Backend("c-int16", "int16", ANY_ROWS, EXACT_TOL, _bind_quant("int16"), _quant_twin("int16")),
    Backend("c-int8", "int8", quant.DIRECT_INT_ROWS["int8"], EXACT_TOL, _bind_quant("int8"), _quant_twin("int8")),
    Backend("c-int8-vnni", "int8", ANY_ROWS, EXACT_TOL, _bind_int8_gemm, _quant_twin("int8")),
    Backend("dequant-mkl", "exact", ANY_ROWS, EXACT_TOL, _bind_dequant, _quant_twin("float")),
    Backend("int4pack", "exact", ANY_ROWS, EXACT_TOL, _bind_int4pack, _quant_twin("float")),
)

BY_NAME = {b.name: b for b in FLOAT + QUANT}
# the C back-ends that compute each --quant-activations mode's products (kernels.quant.matmul_int_twin)
ACTIVATION_BACKENDS = {"float": ("c-float",), "int16": ("c-int16",), "int8": ("c-int8", "c-int8-vnni")}


def for_weight(weight) -> tuple[Backend, ...]:
    return QUANT if isinstance(weight, quant.QuantTensor) else FLOAT
