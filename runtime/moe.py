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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
        h = F.linear(x[rows], gate_up[e])
        y = F.linear(act(h[:, :inter]) * h[:, inter:], down[e])
        out.index_add_(0, rows, (y * scale[start:start + n, None]).to(out.dtype))
        if touched is not None:
            touched.append(e)
        start += n
    return out


def experts_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  act=F.silu) -> torch.Tensor:
    """The slow obvious twin of experts_grouped: every expert computed for every token, the
    results combined by a (T, E) matrix holding each token's routing weights (zero elsewhere)."""
    combine = torch.zeros(x.shape[0], gate_up.shape[0], dtype=weights.dtype).scatter_(1, ids, weights)
    h = torch.einsum("th,eoh->teo", x, gate_up)  # (T, E, 2 I)
    inter = down.shape[2]
    y = torch.einsum("tei,ehi->teh", act(h[..., :inter]) * h[..., inter:], down)  # (T, E, hidden)
    return (y * combine[..., None]).sum(dim=1).to(x.dtype)


class MoEBlock:
    """One MoE layer's weights as plain tensors and callables, for the fused CPU path and a
    tensor-parallel rank: router (E, hidden) float, gate_up (E, 2 I, hidden), down (E, hidden, I)
    (a rank's share of I), and for Qwen2-MoE shared(x) -> the shared expert's output and
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
        else:
            out = experts_grouped(x, weights, ids, self.gate_up, self.down, touched=self.touched)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def expert_bytes(self) -> int:
        """Bytes of one expert's matrices (gate, up and down)."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()
