"""A linear layer's matmul, y = x @ W^T + b, in the form the CPU runs fastest: the one seam every
projection of the model (and the LM head) goes through on the fast path.

Lifecycle: `PackedLinear(weight, bias, kind)` is built once when the model's weights are loaded
and kept for the process; `__call__(x)` runs per step. Kinds:
- `torch`: F.linear on the weight as loaded (what nn.Linear does; the slow twin);
- `onednn`: the weight reordered once into oneDNN's blocked layout and multiplied with
  `mkldnn._linear_pointwise`, what inductor's weight prepacking (and vLLM's CPU path) emits.
`auto` is torch. oneDNN builds and caches one primitive per distinct row count (about 0.6 MB
each for these shapes, up to 1,024 of them): a prefill worker, whose batches have every row
count, grew by 120 MB over a 1,000-request soak, for a gain of ~5% on batch-32 decode steps
measured on an AVX2 EPYC (and none on prefill-sized batches). A quantised weight format
(issue 16) is meant to be one more kind behind the same call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KINDS = ("auto", "torch", "onednn")


def resolve_kind(kind: str, weight: torch.Tensor) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS}")
    return "torch" if kind == "auto" else kind


class PackedLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "auto", batch_hint: int = 32):
        self.kind = resolve_kind(kind, weight)
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # kept: the twin, and the tied embedding reads it
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if self.kind == "onednn" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
