"""Mixture-of-experts layers (Mixtral, Qwen3-MoE, Qwen2-MoE), written once for every path.

Lifecycle: nothing is built here; runtime.model's `MoE` module, runtime.cpu_forward's fast
path and runtime.tp_model's ranks each hold a layer's weights (the router (E, hidden), the
experts' stacked gate/up rows (E, 2 I, hidden) and down matrices (E, hidden, I), and Qwen2-MoE's
shared expert with its gate) and call `route` and `experts_grouped` on every step.

`route` is transformers' TopKRouter: logits in the model dtype, softmax in float32, torch.topk
over the probabilities (so ties break as torch.topk breaks them), renormalised when
norm_topk_prob (Mixtral always: its softmax over the top-k logits is this), cast to the model
dtype unless the family multiplies in float32 (Mixtral). `experts_grouped` is the fast path:
tokens are grouped by expert and each chosen expert's matrices are read as a view of its slice
of the stacks, so a step reads only the experts some token chose (a decode token of Mixtral: 2
of 8). `experts_dense` is its slow obvious twin: every expert on every token, weighted by a
dense (tokens, experts) matrix that is zero for the experts a token did not choose; the tests
compare the two (and show the grouped path never reads an unchosen expert: NaN weights there
leave its output finite, the dense twin's not).

A stack is either a float tensor (E, rows, cols) or, for a GGUF loaded with keep_quantized
(`--quantization auto`), experts kept in their GGUF blocks, multiplied expert by expert
(`expert_linear`): runtime.model's `QuantExpertStack` (the module forward: the Triton weight-only
kernel on CUDA, dequantize-this-expert + F.linear elsewhere) and `PackedExperts` here (the CPU
fast path: one kernels.linear.PackedLinear per expert and part, the C quantized kernels reading
that expert's blocks in place). Either way a step reads the chosen experts' bytes only; the dense
twin dequantizes the whole stack (`stack_float`). On CUDA, float stacks run through
kernels.triton_moe's fused kernels (tokens sorted by expert, one tile of one expert per program):
MoEBlock's CUDA branch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.linear import PackedLinear, SplitLinear
from pdserve.kernels.quant import QuantExperts
from pdserve.runtime.blocks import ExpertBlocks


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, float_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k), expert ids (T, k)) from router logits (T, E), as transformers routes."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float_weights else weights.to(logits.dtype)), ids


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    act=F.silu, touched: list | None = None) -> torch.Tensor:
    """sum over each token's chosen experts e of weight * down[e] @ (act(gate) * up) with
    (gate, up) = gate_up[e] @ x: the tokens grouped by expert, one pair of GEMMs per chosen
    expert, reading only its slice of the stacks. touched: the chosen experts' ids are appended
    (the benchmark counts the bytes they read)."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments sorted by expert, tokens ascending within one
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    scale = weights.reshape(-1)[order]
    inter = down.shape[2]
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start:start + n]
        h = expert_linear(gate_up, e, x[rows])
        y = expert_linear(down, e, act(h[:, :inter]) * h[:, inter:])
        out.index_add_(0, rows, (y * scale[start:start + n, None]).to(out.dtype))
        if touched is not None:
            touched.append(e)
        start += n
    return out


def experts_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  act=F.silu) -> torch.Tensor:
    """The slow obvious twin of experts_grouped: every expert computed for every token, the
    results combined by a (T, E) matrix holding each token's routing weights (zero elsewhere)."""
    gate_up, down = stack_float(gate_up), stack_float(down)
    combine = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype).scatter_(1, ids, weights)
    h = torch.einsum("th,eoh->teo", x, gate_up)  # (T, E, 2 I)
    inter = down.shape[2]
    y = torch.einsum("tei,ehi->teh", act(h[..., :inter]) * h[..., inter:], down)  # (T, E, hidden)
    return (y * combine[..., None]).sum(dim=1).to(x.dtype)


def expert_linear(stack, e: int, x: torch.Tensor) -> torch.Tensor:
    """x @ W_e^T for expert e of a stack: a float stack's slice, or a stack kept in blocks
    (its `linear(e, x)`, which reads expert e's blocks only)."""
    return F.linear(x, stack[e]) if isinstance(stack, torch.Tensor) else stack.linear(e, x)


def stack_float(stack) -> torch.Tensor:
    """The whole stack (E, rows, cols) as float (the dense twin's; a block stack dequantized)."""
    return stack if isinstance(stack, torch.Tensor) else stack.dequantize()


def stack_bytes(stack) -> int:
    return stack.numel() * stack.element_size() if isinstance(stack, torch.Tensor) else stack.nbytes


class PackedExperts:
    """A stack of experts kept in GGUF blocks, for the CPU fast path: `parts` are
    kernels.quant.QuantExperts whose rows stand side by side (gate_up: one stack when gate and up
    share a type, else the two), and expert e multiplies through one PackedLinear per part over
    that expert's blocks (views of the stack: nothing copied, the C kernels read them in place;
    a part in another type: a SplitLinear). Built once with the fast path."""

    def __init__(self, parts: tuple[QuantExperts, ...], activations: str = "float"):
        self.parts = parts
        self.blocks = ExpertBlocks(tuple(parts))
        self.shape, self.nbytes = self.blocks.shape, self.blocks.nbytes

        def expert(e):
            lins = [PackedLinear(p.expert(e), activations=activations) for p in parts]
            return lins[0] if len(lins) == 1 else SplitLinear(lins)

        self.experts = [expert(e) for e in range(self.shape[0])]

    def linear(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x)

    def dequantize(self) -> torch.Tensor:
        return self.blocks.dequantize()


class MoEBlock:
    """One MoE layer's weights as plain tensors and callables, for the fused CPU path and a
    tensor-parallel rank: router (E, hidden) float, gate_up (E, 2 I, hidden), down (E, hidden, I)
    (a rank's share of I; float stacks or stacks kept in blocks, PackedExperts), and for Qwen2-MoE shared(x) -> the shared expert's output and
    shared_gate (1, hidden). `dense` swaps in experts_dense (tests)."""

    def __init__(self, cfg, router, gate_up, down, shared=None, shared_gate=None):
        self.top_k, self.norm, self.float_weights = cfg.experts_per_tok, cfg.norm_topk_prob, cfg.router_weights_float
        self.router, self.gate_up, self.down = router, gate_up, down
        self.shared, self.shared_gate = shared, shared_gate
        self.dense = False
        self.touched: list | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router), self.top_k, self.norm, self.float_weights)
        if self.dense:
            out = experts_dense(x, weights, ids, self.gate_up, self.down)
        elif x.is_cuda and isinstance(self.gate_up, torch.Tensor) and isinstance(self.down, torch.Tensor):
            from pdserve.kernels import triton_moe  # CUDA: the fused Triton kernels (their twin: experts_dense)

            out = triton_moe.fused_moe(x, weights, ids, self.gate_up, self.down)
        else:
            out = experts_grouped(x, weights, ids, self.gate_up, self.down, touched=self.touched)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def expert_bytes(self) -> int:
        """Bytes of one expert's matrices (gate, up and down): float, or its blocks."""
        return (stack_bytes(self.gate_up) + stack_bytes(self.down)) // self.gate_up.shape[0]
