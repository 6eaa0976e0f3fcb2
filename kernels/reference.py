"""The slow, obvious paged attention that every fast path is tested against.

Lifecycle: stateless; `paged_attention_ref` is called by tests (and by `paged_attention(...,
backend="reference")`) on small inputs. For each sequence it gathers the keys/values of every
context position one slot at a time from the pages, builds the causal mask (and the sliding
window's, `window` > 0: a query at position p sees keys p - window < k <= p) explicitly, soft-caps
the scores where asked (`softcap` > 0: s -> softcap * tanh(s / softcap)) and runs a float32 softmax. A quantized cache's
slots (kernels.kv_quant) are dequantized to float32 as they are gathered. Nothing here is meant
to be fast, only to be plainly right.
"""
from __future__ import annotations

import torch

from . import kv_quant


def paged_attention_ref(
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
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of the varlen query tokens `q` (T, H, D) over their paged context; returns (T, H, D).
    window > 0: each query sees only the last `window` positions up to its own."""
    del max_query_len  # only a hint for the fast paths
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        k, v = gather_context(k_cache, v_cache, block_tables[i], seq_len)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, seq_len, scale, window, softcap).to(q.dtype)
    return out


def gather_context(k_cache, v_cache, block_table, seq_len: int):
    """K and V of positions 0..seq_len-1 of one sequence, each (S, KVH, D)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table.long()[pos // block_size]  # (S,)
    offsets = pos % block_size
    return kv_quant.readable(k_cache[blocks, offsets]), kv_quant.readable(v_cache[blocks, offsets])


def _attend(q, k, v, seq_len: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Float32 causal attention of q (L, H, D) on k, v (S, KVH, D); query j sits at position S - L + j
    and sees keys at positions (S - L + j - window, S - L + j] (window 0: from 0)."""
    q_len, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # (S, H, D)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale  # (H, L, S)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # (L,)
    k_pos = torch.arange(seq_len, device=q.device)  # (S,)
    allowed = k_pos[None, :] <= q_pos[:, None]  # (L, S)
    if window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v)  # (L, H, D)
