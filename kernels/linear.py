"""A linear layer's matmul, y = x @ W^T + b, in the form the CPU runs fastest: the one seam every
projection of the model (and the LM head) goes through on the fast path.

Lifecycle: `PackedLinear(weight, bias, kind)` is built once when the model's weights are loaded
and kept for the process; `__call__(x)` runs per step. Kinds:
- `torch`: F.linear on the weight as loaded (what nn.Linear does; the slow twin);
- `onednn`: the weight reordered once into oneDNN's blocked layout and multiplied with
  `mkldnn._linear_pointwise`, what inductor's weight prepacking (and vLLM's CPU path) emits;
- `auto` (the default on the CPU in float32): the C tiled kernel (kernels/csrc/quant_ops.c
  `pd_f_matmul`, reading W in place) for NATIVE_ROWS (8-48 rows), onednn for the other
  decode-sized batches (at most ONEDNN_MAX_ROWS rows), F.linear above: at each size the fastest
  of the three as measured (docs/performance.md, "How the CPU runs the model").
oneDNN builds a primitive for every distinct row count, kept for good (a prefill worker's memory
grew over the soak until this was bounded). So onednn pads the rows
up to a bucket (1, 2, 4, 8, then multiples of 8; zero rows, sliced off the result): a bounded set of
row counts per weight (19). The packed copy doubles the memory of the weights it packs.
- `quant`: the weight is a kernels.quant.QuantTensor (GGUF Q4_0/Q4_1/Q8_0 blocks, `--quantization
  auto`), multiplied by kernels.quant.matmul; chosen by the weight's type whatever the kind asked.
  Its blocks and its 16-row GEMV copy (kernels.cpu_native gemv16_copy) are read-only maps of the
  GGUF and of the node's weight-cache files where the loader gave the weight an origin
  (runtime.weight_cache): one copy per node, not per process. The oneDNN reorder of a float
  weight (and int4pack's, bf16's, int8pack's copies) is still made per process: oneDNN's blocked
  tensor owns its memory, which cannot be a file map.
Those are the rules. `use(rows_backends)` replaces them with a measured table's row for this
weight's shape (kernels.select; back-ends by name from kernels.backends): each call then runs the
back-end of the smallest bucket that holds its rows (the last bucket's above), bound once here;
the rules' oneDNN copy is dropped unless the table uses it.
`SplitLinear(parts)`: a fused projection (qkv, gate_up) whose parts are GGUF blocks of different
types, one PackedLinear each writing its columns of one output (built with them, at load).
"""
from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from pdserve.kernels import backends, quant
from pdserve.kernels.backends import row_bucket

KINDS = ("auto", "torch", "onednn")
ONEDNN_MAX_ROWS = 128  # auto: larger batches (prefill) go to F.linear
NATIVE_ROWS = (8, 48)  # auto: row counts the C tiled kernel takes (fewer: padded to 8 it loses; more: oneDNN is as fast)


def resolve_kind(kind: str, weight: torch.Tensor) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS}")
    if kind == "auto" and not (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()):
        return "torch"
    return kind


class PackedLinear:
    def __init__(self, weight: torch.Tensor | quant.QuantTensor, bias: torch.Tensor | None = None, kind: str = "auto",
                 batch_hint: int = 32, activations: str = "float"):
        self.quantized = isinstance(weight, quant.QuantTensor)
        self.activations = activations  # quant only: how kernels.quant.matmul takes a small batch (float, int16, int8; DIRECT_INT_ROWS)
        self.kind = "quant" if self.quantized else resolve_kind(kind, weight)
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # kept: the twin, and the tied embedding reads it
        self.bias = bias
        self.max_rows = ONEDNN_MAX_ROWS if self.kind == "auto" else (1 << 62 if self.kind == "onednn" else 0)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if self.max_rows else None
        self.onednn = backends.onednn_run(self.packed) if self.packed is not None else None
        self.q_run = quant.bound_matmul(weight, activations) if self.quantized else None
        self.q_rows = quant.kernel_rows(activations)  # quant: rows the C kernel takes
        self.f_run = _native_float(weight) if self.kind == "auto" else None
        self.plan_rows: list[int] = []  # a measured table's buckets for this shape, ascending (use)
        self.plan_names: list[str] = []
        self.plan_runs: list = []

    def use(self, rows_backends: list[tuple[int, str]]) -> None:
        """Dispatch by a measured table's [(bucket, back-end name)] for this weight's shape."""
        kinds = backends.for_weight(self.weight)
        runs = {name: backends.BY_NAME[name].bind(self.weight) if backends.BY_NAME[name] in kinds else None
                for name in {n for _, n in rows_backends}}
        missing = [n for n, r in runs.items() if r is None]
        if missing:
            raise ValueError(f"linear back-end(s) {', '.join(missing)} cannot run a {tuple(self.weight.shape)} weight here")
        self.plan_rows = [b for b, _ in rows_backends]
        self.plan_names = [n for _, n in rows_backends]
        self.plan_runs = [runs[n] for n in self.plan_names]
        self.packed = self.onednn = None  # the rules' oneDNN copy (the table's own is bound above where it uses oneDNN)

    def _slot(self, rows: int) -> int:
        """The table's entry for `rows` rows: the smallest bucket that holds them (the last above)."""
        return min(bisect.bisect_left(self.plan_rows, rows), len(self.plan_rows) - 1)

    def backend_at(self, rows: int) -> str:
        """The back-end name that runs `rows` rows ('rules' without a table)."""
        return self.plan_names[self._slot(rows)] if self.plan_rows else "rules"

    def warm(self) -> None:
        """Build oneDNN's primitive for every row bucket now (~0.1 s per weight shape), so that
        memory is flat from the first request on instead of growing as new batch sizes appear."""
        top = self.plan_rows[-1] if any(n.startswith("onednn") for n in self.plan_names) else (
            min(self.max_rows, ONEDNN_MAX_ROWS) if self.packed is not None else 0)
        for rows in sorted({row_bucket(r) for r in range(1, top + 1)}):
            self(torch.zeros((rows, self.in_features)))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias); `out`, a (rows, out_features) buffer the quantized kernel may write
        into (the result is returned either way; other kinds allocate)."""
        if self.plan_runs:
            out = self.plan_runs[self._slot(x.shape[0])](x, out)
            return out if self.bias is None else out.add_(self.bias)
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
        out = self.onednn(x)
        return out if self.bias is None else out.add_(self.bias)


def _native_float(weight: torch.Tensor):
    """The C tiled kernel bound to a float32 weight, or None (no C kernels, or not built for this CPU)."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    return ops.f_linear(weight) if ops is not None and weight.is_contiguous() else None


class SplitLinear:
    """A fused projection whose parts are quantized in different types (runtime.model.QuantRows:
    a Q4_K_M file's Q4_K q / k and Q6_K v): each part's PackedLinear writes its columns of the
    output (the one-call decode step takes the parts the same way: step_ops.c pd_layer.qkv[]);
    the module forward (dequantize + F.linear per part) is its twin."""

    quantized = False  # not one block matrix: its parts are (runtime.cpu_forward._step_layers)
    bias = None  # each part adds its own

    def __init__(self, parts: list[PackedLinear]):
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype) if out is None else out
        col = 0
        for part in self.parts:
            out[:, col:col + part.out_features] = part(x)
            col += part.out_features
        return out

