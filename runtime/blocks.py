"""Weights kept in GGUF blocks in the module forward of runtime.model, and the loader's joins that
keep them so: `_stack_rows` (q/k/v, gate/up: one QuantTensor when the parts share a type, else
`MixedBlocks`, whose module is `QuantRows`), `moe_tensors` (a MoE layer's stacks: `ExpertBlocks`,
whose module is `QuantExpertStack`), `QuantLinear` (one matrix in blocks).

Lifecycle: runtime.model.LlamaModel.load_weights builds these modules once from the loader's
tensors; runtime.cpu_forward (the CPU fast path) and runtime.tp_model read their blocks when
they are built. The blocks keep their origin (kernels.quant.Origin: the node's weight cache)
while on the CPU, so that the fast path's re-layouts of them are the node's shared files. Apart
from runtime.model so that those can import them without importing the model that imports them (the import graph has no circles: tests/test_import_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.quant import QuantExperts, QuantTensor


@dataclass(frozen=True)
class MixedBlocks:
    """Quantized matrices of different types (a Q4_K_M file's Q4_K q / k and Q6_K v) whose rows
    stand for one fused matrix: QuantTensor.cat cannot join them, and a float32 copy would cost 4
    bytes a weight (~7x Q4_K's), so each stays in its blocks (the module: `QuantRows`)."""

    parts: tuple[QuantTensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


def _stack_rows(parts: list) -> torch.Tensor | QuantTensor | MixedBlocks:
    """q/k/v or gate/up as one matrix: quantized blocks stay blocks, in one QuantTensor when all
    parts share a type, else side by side (MixedBlocks); float where any part is float."""
    if all(isinstance(p, QuantTensor) for p in parts):
        return QuantTensor.cat(parts) or MixedBlocks(tuple(parts))
    return torch.cat([p.dequantize() if isinstance(p, QuantTensor) else p for p in parts])


def _float(w) -> torch.Tensor:
    return w.dequantize() if isinstance(w, (QuantTensor, QuantExperts)) else w


@dataclass(frozen=True)
class ExpertBlocks:
    """An expert stack kept in GGUF blocks: one QuantExperts, or (gate_up, when gate and up differ
    in type) several whose rows stand side by side per expert (the module: `QuantExpertStack`)."""

    parts: tuple[QuantExperts, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.parts[0].shape[0], sum(p.shape[1] for p in self.parts), self.parts[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The whole stack (E, rows, cols) as float32: the parts' rows side by side per expert."""
        return torch.cat([p.dequantize() for p in self.parts], dim=1)


def _expert_stack(parts: list) -> torch.Tensor | ExpertBlocks:
    """gate + up (or down alone) as one stack: blocks stay blocks (one QuantExperts when the parts
    share a type, else side by side); float where any part is not a natively served block type."""
    if all(isinstance(p, QuantExperts) for p in parts):
        joined = QuantExperts.cat(parts)
        return ExpertBlocks((joined,) if joined is not None else tuple(parts))
    return torch.cat([_float(p) for p in parts], dim=1)


def moe_tensors(tensors: dict, src: str, dst: str, shared: bool) -> dict:
    """One MoE layer's loader tensors (runtime.weights: `mlp.gate.weight`, the stacks
    `mlp.experts.gate_proj` / `up_proj` / `down_proj`, Qwen2-MoE's `mlp.shared_expert.*` and
    `mlp.shared_expert_gate.weight`) under `src`, as the MoE module's parameters under `dst`: gate
    and up rows stacked per expert; the router float; the experts' stacks kept in their blocks
    where the loader kept them (kernels.quant.QuantExperts -> ExpertBlocks, the module a
    QuantExpertStack), else float; the shared expert's matrices kept as blocks where they can be."""
    m = src + "mlp."
    out = {dst + "gate.weight": _float(tensors[m + "gate.weight"]),
           dst + "experts_gate_up": _expert_stack([tensors[m + "experts.gate_proj"], tensors[m + "experts.up_proj"]]),
           dst + "experts_down": _expert_stack([tensors[m + "experts.down_proj"]])}
    if shared:
        s = m + "shared_expert."
        out[dst + "shared_expert.gate_up_proj.weight"] = _stack_rows([tensors[s + "gate_proj.weight"], tensors[s + "up_proj.weight"]])
        out[dst + "shared_expert.down_proj.weight"] = tensors[s + "down_proj.weight"]
        out[dst + "shared_expert_gate.weight"] = _float(tensors[m + "shared_expert_gate.weight"])
    return out


class QuantLinear(nn.Module):
    """A matrix kept in GGUF blocks (kernels.quant.QuantTensor) in the module forward: a linear
    layer (`forward`) or, for the embedding, a row lookup (`rows`). Its bytes are a buffer, so
    `.to(device)` moves them. On a CUDA device it multiplies with the Triton weight-only kernel
    (kernels.triton_quant: the blocks are read as they are); elsewhere with the twin (dequantize,
    F.linear), which is slow and exists for tests: the CPU serves quantized weights through
    runtime.cpu_forward, which reads the same blocks."""

    def __init__(self, w: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("raw", w.raw)
        self.qtype, self.shape, self.origin = w.qtype, w.shape, w.origin
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def blocks(self) -> QuantTensor:
        """The blocks (with their origin while they stay on the CPU: their re-layouts are the node's shared ones)."""
        return QuantTensor(self.raw, self.qtype, self.shape, self.origin if self.raw.device.type == "cpu" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pdserve.kernels import triton_quant

            return triton_quant.matmul(x.contiguous(), self.blocks, self.bias)
        return F.linear(x, self.blocks.dequantize().to(x.dtype), self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup), in plain torch on any device."""
        return self.blocks.rows(ids).to(dtype)


class QuantExpertStack(nn.Module):
    """A MoE layer's expert stack kept in GGUF blocks (ExpertBlocks) in the module forward: each
    part's (E, rows, row bytes) bytes a buffer (`.to(device)` moves them). `linear(e, x)` reads
    expert e's blocks only: on CUDA the Triton weight-only kernel (kernels.triton_quant), elsewhere
    the twin (that expert dequantized, F.linear); the CPU serves it through runtime.cpu_forward's
    runtime.moe.PackedExperts over the same bytes."""

    def __init__(self, w: ExpertBlocks):
        super().__init__()
        for i, p in enumerate(w.parts):
            self.register_buffer(f"raw{i}", p.raw)
        self.qtypes, self.part_shapes, self.origins = [p.qtype for p in w.parts], [p.shape for p in w.parts], [p.origin for p in w.parts]
        self.shape = w.shape

    @property
    def parts(self) -> tuple[QuantExperts, ...]:
        raws = [getattr(self, f"raw{i}") for i in range(len(self.qtypes))]
        return tuple(QuantExperts(r, t, s, o if r.device.type == "cpu" else None)
                     for r, t, s, o in zip(raws, self.qtypes, self.part_shapes, self.origins))

    @property
    def nbytes(self) -> int:
        return ExpertBlocks(self.parts).nbytes

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pdserve.kernels import triton_quant

            outs = [triton_quant.matmul(x.contiguous(), p.expert(e)) for p in self.parts]
        else:
            outs = [F.linear(x, p.expert(e).dequantize().to(x.dtype)) for p in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def dequantize(self) -> torch.Tensor:
        return ExpertBlocks(self.parts).dequantize()


class QuantRows(nn.Module):
    """A fused projection (qkv, gate_up) whose parts are quantized in different types
    (MixedBlocks): one QuantLinear per part, their outputs side by side; the bias, if any, split
    among them. The CPU fast path runs the parts as one PackedLinear each (cpu_forward.SplitLinear)."""

    def __init__(self, w: MixedBlocks, bias: torch.Tensor | None = None):
        super().__init__()
        ends = torch.tensor([p.shape[0] for p in w.parts]).cumsum(0).tolist()
        self.parts = nn.ModuleList(QuantLinear(p, None if bias is None else bias[e - p.shape[0]:e]) for p, e in zip(w.parts, ends))
        self.bias = None  # each part holds its slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
