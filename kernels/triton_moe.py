"""The fused mixture-of-experts layer as Triton kernels (vLLM's fused_moe design), for CUDA; on CPU
tensors it runs under TRITON_INTERPRET=1 (how the tests check it where no GPU is lent).

Lifecycle: imported lazily by runtime.moe the first time a MoE layer with float expert stacks
runs on a CUDA device (or in a test under the interpreter); each kernel compiles once per
(dtype, tile) and Triton caches it. Per call:
1. `align(ids, experts, block_m)` (torch): every (token, slot) assignment, flattened as
   token * top_k + slot, sorted by expert and padded per expert to a multiple of BLOCK_M with an
   index past the end (`padded`), so that each BLOCK_M-row tile of the sorted list belongs to one
   expert (`tile_experts`). Tiles of experts no token chose do not exist: the kernels read no byte
   of those experts' weights.
2. `_expert_gemm` over the tiles: one program computes (BLOCK_M assignments) x (BLOCK_N outputs)
   of `A[row] @ W[e]^T`, reading the tile's expert's weight rows only; the first call's A row is
   the assignment's token (x, (T, hidden)) against the gate/up stack (E, 2 I, hidden); the second's
   is the assignment itself (act(gate) * up, (T * top_k, I)) against the down stack (E, hidden, I),
   times the assignment's routing weight (MUL_WEIGHT). float32 accumulation; float32 inputs use
   exact ("ieee") products, half types the tensor cores.
3. The top_k rows of each token summed (torch), in the activations' dtype.
The slow obvious twin is runtime.moe.experts_dense (every expert on every token); the tests
compare them, and show that an expert nobody chose is never read (NaN weights there leave the
output finite).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted assignments padded per expert to a multiple of block_m, with ids.numel() as the pad;
    each block_m tile's expert). ids: (T, top_k) expert ids."""
    flat = ids.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    padded_counts = (counts + block_m - 1) // block_m * block_m
    total = int(padded_counts.sum())
    starts = torch.cumsum(padded_counts, 0) - padded_counts  # each expert's first slot in the padded list
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    rank = torch.arange(n, device=ids.device) - firsts[flat[order]]  # place of an assignment within its expert
    padded = torch.full((total,), n, dtype=torch.int32, device=ids.device)
    padded[starts[flat[order]] + rank] = order.to(torch.int32)
    tile_experts = torch.repeat_interleave(torch.arange(experts, device=ids.device, dtype=torch.int32), padded_counts // block_m)
    return padded, tile_experts


@triton.jit
def _expert_gemm(a_ptr, w_ptr, out_ptr, weights_ptr, padded_ptr, tile_experts_ptr, n_assign, N, K,
                 stride_am, stride_we, stride_wn, stride_om,
                 TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    assign = tl.load(padded_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,) flattened (token, slot)
    ok = assign < n_assign
    a_row = assign // TOP_K if A_BY_TOKEN else assign
    e = tl.load(tile_experts_ptr + tile).to(tl.int64)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptr + a_row.to(tl.int64)[:, None] * stride_am + (k0 + rk)[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + e * stride_we + rn.to(tl.int64)[:, None] * stride_wn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + assign, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + assign.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


def _gemm(a, stack, out, weights, padded, tile_experts, top_k: int, by_token: bool, mul_weight: bool, block_m: int) -> None:
    n, k = stack.shape[1], stack.shape[2]
    block_n, block_k = 64, 32
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    _expert_gemm[grid](a, stack, out, weights, padded, tile_experts, out.shape[0], n, k,
                       a.stride(0), stack.stride(0), stack.stride(1), out.stride(0),
                       TOP_K=top_k, A_BY_TOKEN=by_token, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       DOT_PRECISION=precision)


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              act=F.silu) -> torch.Tensor:
    """sum over each token's chosen experts e of weight * down[e] @ (act(gate) * up), (gate, up) =
    gate_up[e] @ x, as runtime.moe.experts_grouped computes it. x (T, hidden); weights, ids
    (T, top_k); gate_up (E, 2 I, hidden), down (E, hidden, I): float stacks, contiguous, on x's
    CUDA device (or the CPU under TRITON_INTERPRET=1)."""
    T, hidden = x.shape
    E, two_i, _ = gate_up.shape
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"triton fused MoE: x on {x.device} is not a CUDA tensor (set TRITON_INTERPRET=1 to interpret it)")
    if gate_up.shape[2] != hidden or down.shape[:2] != (E, hidden) or down.shape[2] * 2 != two_i:
        raise ValueError(f"triton fused MoE: stacks {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit x {tuple(x.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    top_k = ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    block_m = 16 if T * top_k <= 64 * E else 64
    padded, tile_experts = align(ids, E, block_m)
    h = torch.empty((T * top_k, two_i), dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, weights, padded, tile_experts, top_k, True, False, block_m)
    inter = two_i // 2
    y_in = (act(h[:, :inter]) * h[:, inter:]).contiguous()
    y = torch.empty((T * top_k, hidden), dtype=x.dtype, device=x.device)
    _gemm(y_in, down, y, weights.reshape(-1).contiguous(), padded, tile_experts, top_k, False, True, block_m)
    return y.view(T, top_k, hidden).sum(dim=1)
