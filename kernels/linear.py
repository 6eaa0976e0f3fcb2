"""A linear layer's matmul, y = x @ W^T + b, in the form the CPU runs fastest: the one seam every
projection of the model (and the LM head) goes through on the fast path.

Lifecycle: `PackedLinear(weight, bias, kind)` is built once when the model's weights are loaded
and kept for the process; `__call__(x)` runs per step. Kinds:
- `torch`: F.linear on the weight as loaded (what nn.Linear does; the slow twin);
- `onednn`: the weight reordered once into oneDNN's blocked layout and multiplied with
  `mkldnn._linear_pointwise`, what inductor's weight prepacking (and vLLM's CPU path) emits;
- `auto` (the default on the CPU in float32): the C tiled kernel (kernels/csrc/quant_ops.c
  `pd_f_matmul`, reading W in place) for NATIVE_ROWS (8-48 rows: a batch-32 step's GEMMs 102
  against oneDNN's 130 ms, alternating, same process; at 64 rows even, at 128 oneDNN ahead),
  onednn for the other decode-sized batches (at most
  ONEDNN_MAX_ROWS rows), F.linear above. Measured side by side on a quiet 2-core AVX2 EPYC, 2
  threads: a batch-32 step's GEMMs take 78 ms with oneDNN against 110 ms with MKL's F.linear
  (the 49152-wide LM head alone 17 against 34 ms), while at prefill sizes (512, 2048 rows)
  F.linear is 5-11% faster.
oneDNN builds a primitive for every distinct row count (3.5 ms to create, about 0.6 MB kept,
never freed: a prefill worker grew 120 MB over the 1,000-request soak). So onednn pads the rows
up to a bucket (1, 2, 4, 8, then multiples of 8; zero rows, sliced off the result): a bounded set of
row counts per weight (19). The packed copy doubles the memory of the weights it packs.
- `quant`: the weight is a kernels.quant.QuantTensor (GGUF Q4_0/Q4_1/Q8_0 blocks, `--quantization
  auto`), multiplied by kernels.quant.matmul; chosen by the weight's type whatever the kind asked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import quant

KINDS = ("auto", "torch", "onednn")
ONEDNN_MAX_ROWS = 128  # auto: larger batches (prefill) go to F.linear
NATIVE_ROWS = (8, 48)  # auto: row counts the C tiled kernel takes (fewer: padded to 8 it loses; more: oneDNN is as fast)


def resolve_kind(kind: str, weight: torch.Tensor) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS}")
    if kind == "auto" and not (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()):
        return "torch"
    return kind


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN runs for `rows` rows: 1, 2, 4, 8, then the next multiple of 8."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


class PackedLinear:
    def __init__(self, weight: "torch.Tensor | quant.QuantTensor", bias: torch.Tensor | None = None, kind: str = "auto",
                 batch_hint: int = 32, activations: str = "float"):
        self.quantized = isinstance(weight, quant.QuantTensor)
        self.activations = activations  # quant only: how kernels.quant.matmul takes a small batch (float, int16, int8; DIRECT_INT_ROWS)
        self.kind = "quant" if self.quantized else resolve_kind(kind, weight)
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # kept: the twin, and the tied embedding reads it
        self.bias = bias
        self.max_rows = ONEDNN_MAX_ROWS if self.kind == "auto" else (1 << 62 if self.kind == "onednn" else 0)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if self.max_rows else None
        self.q_run = quant.bound_matmul(weight, activations) if self.quantized else None
        self.q_rows = quant.kernel_rows(activations)  # quant: rows the C kernel takes
        self.f_run = _native_float(weight) if self.kind == "auto" else None

    def warm(self) -> None:
        """Build oneDNN's primitive for every row bucket now (~0.1 s per weight shape), so that
        memory is flat from the first request on instead of growing as new batch sizes appear."""
        if self.packed is not None:
            for rows in sorted({row_bucket(r) for r in range(1, min(self.max_rows, ONEDNN_MAX_ROWS) + 1)}):
                self(self.weight.new_zeros((rows, self.in_features)))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias); `out`, a (rows, out_features) buffer the quantized kernel may write
        into (the result is returned either way; other kinds allocate)."""
        if self.q_run is not None and x.shape[0] <= self.q_rows:
            out = self.q_run(x, out)
            return out if self.bias is None else out.add_(self.bias)
        if self.quantized:
            return quant.matmul(x, self.weight, self.bias, self.activations)
        rows = x.shape[0]
        if self.f_run is not None and NATIVE_ROWS[0] <= rows <= NATIVE_ROWS[1] and x.stride(1) == 1:
            out = self.f_run(x, out)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is None or rows > self.max_rows or rows == 0:
            return F.linear(x, self.weight, self.bias)
        bucket = row_bucket(rows)
        if bucket != rows:
            padded = x.new_zeros((bucket, x.shape[1]))
            padded[:rows] = x
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _native_float(weight: torch.Tensor):
    """The C tiled kernel bound to a float32 weight, or None (no C kernels, or not built for this CPU)."""
    from kernels import cpu_native

    ops = cpu_native.native()
    return ops.f_linear(weight) if ops is not None and weight.is_contiguous() else None
