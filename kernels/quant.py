"""GGUF block-quantized weights kept as they are (Q4_0, Q4_1, Q8_0), their matmul and their twin.

Lifecycle: runtime.weights wraps each quantized 2-D tensor of a GGUF file in a `QuantTensor`
(its bytes copied once out of the file map, rows in the file's order) when asked to keep
weights quantized; the model fuses q/k/v and gate/up by concatenating rows (`QuantTensor.cat`);
kernels.linear.PackedLinear then multiplies with `matmul` for the life of the process, and the
embedding lookup reads rows with `rows_float`. `dequantize` is the slow, obvious twin: the same
values gguf's numpy dequantizer gives, in plain torch; the float32 model built from it is what
the tests compare the quantized one with.

Blocks (32 weights each), as llama.cpp writes them:
  Q4_0 (18 bytes): fp16 d, 16 bytes of 4-bit codes   w = d * (q - 8)
  Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of codes  w = d * q + m
  Q8_0 (34 bytes): fp16 d, 32 int8 codes              w = d * q
Low nibbles hold weights 0..15 of a block, high nibbles 16..31. Other GGUF types (K-quants,
I-quants) are dequantized to float at load, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# name -> (ggml type id, bytes per 32-weight block)
QTYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32
DIRECT_ROWS = 128  # float / int8 activations: up to this many rows the C kernel runs; above, dequantize + MKL (prefill sizes)
ANY_ROWS = 1 << 62
# rows up to which the C kernel rounds activations to integers (quant_ops.c): int8 in small decode
# steps only; int16 at every row count (above 7 rows, quant_ops.c q_gemm: 1.1-1.2x dequantize + MKL at
# prompt sizes, 1.3-1.5x the float tiled kernel at 32-64 rows)
DIRECT_INT_ROWS = {"int8": 4, "int16": ANY_ROWS}


def kernel_rows(activations: str) -> int:
    """The most rows the C kernel takes for these activations (more: dequantize + F.linear)."""
    return max(DIRECT_ROWS, DIRECT_INT_ROWS.get(activations, 0))


@dataclass(frozen=True)
class QuantTensor:
    """A (out, in) weight matrix as rows of GGUF blocks: raw is (out, in / 32 * block bytes) uint8."""

    raw: torch.Tensor
    qtype: str
    shape: tuple[int, int]

    def __post_init__(self):
        if self.qtype not in QTYPES:
            raise ValueError(f"{self.qtype} is not a natively served quant type ({', '.join(QTYPES)})")
        rows, cols = self.shape
        if cols % BLOCK or self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (rows, cols // BLOCK * QTYPES[self.qtype][1]):
            raise ValueError(f"{self.qtype} bytes {tuple(self.raw.shape)} do not hold a {self.shape} matrix")
        if not self.raw.is_contiguous():
            raise ValueError("QuantTensor rows must be contiguous")

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def type_id(self) -> int:
        return QTYPES[self.qtype][0]

    def take_rows(self, index: torch.Tensor) -> QuantTensor:
        """The matrix of rows `index` (a row permutation or selection; rows are independent)."""
        raw = self.raw.index_select(0, index).contiguous()
        return QuantTensor(raw, self.qtype, (raw.shape[0], self.shape[1]))

    @staticmethod
    def cat(parts: list) -> QuantTensor | None:
        """Rows of several matrices stacked (q/k/v, gate/up); None unless all are QuantTensors of
        one type and width (the caller then fuses float copies instead)."""
        if not all(isinstance(p, QuantTensor) for p in parts) or len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            return None
        raw = torch.cat([p.raw for p in parts])
        return QuantTensor(raw, parts[0].qtype, (raw.shape[0], parts[0].shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The twin: every weight as float32, the values gguf.quants.dequantize gives."""
        return dequantize_raw(self.raw, self.qtype, self.shape[1])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32 in plain torch, on the blocks' device (the twin of rows_float)."""
        return dequantize_raw(self.raw.index_select(0, index.reshape(-1)), self.qtype, self.shape[1])

    def rows_float(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32 (an embedding lookup), through the C kernel when it is built."""
        from pdserve.kernels import cpu_native

        ops = cpu_native.native()
        if ops is None:
            return self.rows(index)
        return ops.q_dequant(self, index.reshape(-1).to(torch.int64).contiguous())


def dequantize_raw(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """(rows, cols) float32 from rows of blocks, in plain torch."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // BLOCK, QTYPES[qtype][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (rows, nb, 1)
    if qtype == "Q8_0":
        q = blocks[..., 2:34].contiguous().view(torch.int8).float()
        w = d * q
    else:
        codes = blocks[..., 4:20] if qtype == "Q4_1" else blocks[..., 2:18]
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float()
        if qtype == "Q4_1":
            w = d * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = d * (q - 8)
    return w.reshape(rows, cols)


def matmul(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, activations: str = "float") -> torch.Tensor:
    """x (M, K) float32 @ w^T: the C kernel up to kernel_rows(activations) rows, else dequantize and
    F.linear. activations "int16" / "int8": up to DIRECT_INT_ROWS rows are rounded to integers per
    32-wide block first and multiplied in integers (faster; matmul_int_twin is what they compute)."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    if ops is None or x.shape[0] > kernel_rows(activations):
        return F.linear(x, w.dequantize() if ops is None else ops.q_dequant(w), bias)
    out = ops.q_matmul(x, w, activations)
    return out if bias is None else out.add_(bias)


def bound_matmul(w: QuantTensor, activations: str = "float"):
    """The C kernel bound to one weight (kernels.cpu_native.NativeOps.q_linear): x -> x @ w^T for
    at most kernel_rows(activations) rows; None without the C kernels (callers then use `matmul`)."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    return None if ops is None else ops.q_linear(w, activations)


def matmul_twin(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(), bias)


INT_LIMITS = {"int8": 127.0, "int16": 32767.0}  # the largest code of each integer activation kind


def quantize_activations(x: torch.Tensor, kind: str = "int8") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer paths' activations: (codes (M, K), scales dx (M, K/32), block sums (M, K/32)),
    x ~ dx * codes per 32-wide block with dx = max|x| / L (L = 127 for int8, 32767 for int16),
    rounded half to even."""
    rows, cols = x.shape
    limit = INT_LIMITS[kind]
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8 if kind == "int8" else torch.int16)
    return codes.reshape(rows, cols), amax / limit, blocks.sum(-1)


def matmul_int_twin(x: torch.Tensor, w: QuantTensor, kind: str = "int8") -> torch.Tensor:
    """What the C kernel's integer paths (up to DIRECT_INT_ROWS rows) compute, in float64:
    per block d * dx * (codes . xq) + m * sum(x). Its difference from `matmul_twin` is the
    activations' rounding to int8 or int16, which is the price of those paths."""
    rows, cols = x.shape
    nb = cols // BLOCK
    xq, dx, xsum = quantize_activations(x, kind)
    blocks = w.raw.reshape(w.shape[0], nb, QTYPES[w.qtype][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)  # (N, nb)
    if w.qtype == "Q8_0":
        q, m = blocks[..., 2:34].contiguous().view(torch.int8), torch.zeros_like(d)
    else:
        codes = blocks[..., 4:20] if w.qtype == "Q4_1" else blocks[..., 2:18]
        q = torch.cat([codes & 15, codes >> 4], dim=-1)
        m = blocks[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1) if w.qtype == "Q4_1" else -8 * d
    dots = torch.einsum("nbj,mbj->mnb", q.double(), xq.reshape(rows, nb, BLOCK).double())  # exact integers
    return (dots * d.unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1) + xsum.double() @ m.T
