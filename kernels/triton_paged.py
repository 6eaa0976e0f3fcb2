"""Paged attention as Triton kernels: native on CUDA, or on CPU tensors under TRITON_INTERPRET=1.

Lifecycle: imported lazily by `kernels.paged_attention` the first time the triton backend is
used (importing triton is slow, and under the interpreter TRITON_INTERPRET must be set first);
the kernels compile on first launch per shape class and are cached by Triton. Two kernels, both
with an online (flash-style) float32 softmax over key tiles read from the pages through the
block table: a decode kernel with one program per (sequence, kv head) that serves the whole
query-head group of that kv head at once, and a varlen kernel (prefill, chunked prefill over a
cached prefix, mixed batches) with one program per (sequence, tile of query tokens, head).
A sliding window (`window` > 0) masks keys at or before p - window for a query at position p
and starts each program's key loop at the first tile its window reaches; positions of that
tile before the window load nothing, not even their table entries (a sequence of an all-window
model frees those blocks, runtime.kv_cache).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # the window a full-attention call passes: wider than any context
# triton.jit picks interpreter or compiler when the kernels below are decorated, i.e. now.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _load_kv_tile(
    k_ptr, v_ptr, table_ptr, start, first, seq_len, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Keys/values at positions start..start+BLOCK_N of one sequence, (BLOCK_N, BLOCK_D) each; 0
    before `first` (the window's oldest key: its table entries may be freed, runtime.kv_cache) and
    past seq_len, neither page nor table entry read there."""
    n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    d = tl.arange(0, BLOCK_D)
    n_ok = (n >= first) & (n < seq_len)
    # A tile may span several pages, so each key position looks up its own page.
    page = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    offset = n % BLOCK_SIZE
    mask = n_ok[:, None] & (d < HEAD_DIM)[None, :]
    k_rows = page * stride_kb + offset * stride_ks + kv_head * stride_kh
    v_rows = page * stride_vb + offset * stride_vs + kv_head * stride_vh
    k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v, n


@triton.jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold one key tile into the running max m_i (M,), denominator l_i (M,) and output acc (M, D)."""
    if DOT_F32:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N), log2 units
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    qk_scale, window,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    table_ptr = tables_ptr + seq * stride_table
    # Rows are this kv head's query heads, padded to BLOCK_H >= 16 so tl.dot applies.
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    d = tl.arange(0, BLOCK_D)
    q_mask = (tl.arange(0, BLOCK_H) < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    first = tl.maximum(seq_len - window, 0)  # the oldest key the window keeps
    for start in range((first // BLOCK_N) * BLOCK_N, seq_len, BLOCK_N):
        k, v, n = _load_kv_tile(
            k_ptr, v_ptr, table_ptr, start, first, seq_len, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM,
        )
        allowed = ((n < seq_len) & (n >= first))[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_F32)

    out = acc / l_i[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    qk_scale, window,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    table_ptr = tables_ptr + seq * stride_table

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the sequence
    pos = seq_len - q_len + m  # absolute positions of these queries
    d = tl.arange(0, BLOCK_D)
    q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + m) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)

    # Keys past the tile's last query are never visible; tiles past q_len run no iteration.
    key_end = tl.minimum(seq_len, seq_len - q_len + (m_tile + 1) * BLOCK_M)
    key_end = tl.where(m_tile * BLOCK_M < q_len, key_end, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys before the tile's first query's window are never visible either
    key_first = tl.maximum(seq_len - q_len + m_tile * BLOCK_M - window + 1, 0)
    for start in range((key_first // BLOCK_N) * BLOCK_N, key_end, BLOCK_N):
        k, v, n = _load_kv_tile(
            k_ptr, v_ptr, table_ptr, start, key_first, seq_len, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM,
        )
        allowed = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window) & (n < seq_len)[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_PRECISION, DOT_F32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + m) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Attention of the varlen query tokens `q` (T, H, D) over their paged context; returns (T, H, D)."""
    q, k_cache, v_cache = (_unit_last_stride(t) for t in (q, k_cache, v_cache))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    args = _common_args(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window)
    consts = _common_consts(q, k_cache)
    batch = seq_lens.numel()
    if max_query_len == 1:
        _launch_decode(args, consts, batch, k_cache.shape[2])
    else:
        _launch_varlen(args, consts, batch, max_query_len, q.shape[1])
    return out


def _launch_decode(args, consts, batch: int, kv_heads: int) -> None:
    block_h = max(16, triton.next_power_of_2(consts["GROUP"]))
    block_n = 32 if _INTERPRETED or consts["BLOCK_D"] > 128 else 64
    block_n = max(block_n, consts["BLOCK_SIZE"])
    _decode_kernel[(batch, kv_heads)](*args, **consts, BLOCK_H=block_h, BLOCK_N=block_n)


def _launch_varlen(args, consts, batch: int, max_query_len: int, heads: int) -> None:
    # Native tiles like common flash-attention configs, smaller for wide heads so that float32
    # stays within about 100 KB of shared memory; the interpreter prefers small tiles.
    block_m = 16 if _INTERPRETED else (64 if consts["BLOCK_D"] <= 128 else 32)
    block_n = 32 if _INTERPRETED or consts["BLOCK_D"] > 64 else 64
    block_n = max(block_n, consts["BLOCK_SIZE"])
    grid = (batch, triton.cdiv(max_query_len, block_m), heads)
    _varlen_kernel[grid](*args, **consts, BLOCK_M=block_m, BLOCK_N=block_n)


def _common_args(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale: float, window: int = 0):
    return (
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        scale * _LOG2E, window if window > 0 else _NO_WINDOW,
    )


def _common_consts(q, k_cache) -> dict:
    head_dim = q.shape[2]
    return {
        "GROUP": q.shape[1] // k_cache.shape[2],
        "BLOCK_SIZE": k_cache.shape[1],
        "HEAD_DIM": head_dim,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        # tf32 would cost float32 inputs ~1e-3 of accuracy; bf16/fp16 inputs ignore this.
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
        # The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584): upcast there.
        "DOT_F32": _INTERPRETED and q.dtype != torch.float32,
    }


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
