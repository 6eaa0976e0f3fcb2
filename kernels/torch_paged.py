"""Paged attention in plain torch: the production path on CPU (and a fallback anywhere else).

Lifecycle: stateless; `paged_attention_torch` is called once per layer per forward step.
Decode batches (every sequence has one query token) gather the sequences' pages with one
index_select per chunk of sequences and run one masked `F.scaled_dot_product_attention` per
chunk; a lone sequence instead takes the per-sequence path so that its arithmetic is
bit-identical to transformers' sdpa decode. Any batch with a longer query (prefill, chunked
prefill over a cached prefix, mixed batches) runs per sequence: gather its pages, then one sdpa
call shaped like transformers' Llama sdpa path (`is_causal=True` when there is no cached
prefix, otherwise a bottom-right causal mask). A sliding window (`window` > 0, kernels.paged)
narrows the mask to each query's last `window` keys where the context is longer than the
window, as transformers' sliding-window mask does (a lone decode query reads only those keys),
and the pages are gathered from the first one a window reaches (`window_page`): the entries
before it may be freed blocks (runtime.kv_cache) and are never read. A quantized cache
(kernels.kv_quant, --kv-cache-dtype int8 / fp8) is read the same way: the gathered pages are
unpacked (int8: s (c - z) rotated back by the Hadamard matrix; fp8: code * scale) to the query's
dtype before the sdpa call: the slow twin of the C int8 decode kernel (which rotates the query
and the output instead).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kv_quant

# enable_gqa lets sdpa read each KV head for its whole query group without materialising
# repeat_kv; on CPU it is bit-identical to sdpa over repeated K/V, which transformers falls back to.
_SDPA_HAS_GQA = torch.__version__ >= (2, 5)


def paged_attention_torch(
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
    """Attention of the varlen query tokens `q` (T, H, D) over their paged context; returns (T, H, D)."""
    if max_query_len == 1 and seq_lens.numel() > 1:
        return decode_batched(q, k_cache, v_cache, seq_lens, block_tables, scale, window, softcap)
    return varlen_per_sequence(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, window, softcap)


def decode_batched(q, k_cache, v_cache, seq_lens, block_tables, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence, q (B, H, D): batched gather + masked sdpa, in chunks of sequences.

    With a window each sequence's pages are gathered from the first one its window reaches (the
    entries before may be freed: runtime.kv_cache), so a step reads O(window) keys a sequence.
    On CPU the chunks share one gather buffer of about _GATHER_BYTES per cache: a gather of the
    whole batch is a fresh multi-MB allocation each step, whose page faults cost more than the
    copy itself; a small reused buffer bounds that cost.
    """
    lens = seq_lens.tolist()
    bs = k_cache.shape[1]
    firsts = [window_page(n, 1, window, bs) for n in lens]  # each sequence's first page read
    spans = [-(-n // bs) - f for n, f in zip(lens, firsts)]  # and how many from there
    rows = len(lens) if q.is_cuda else min(len(lens), _rows_per_chunk(k_cache, max(spans) * bs))
    k_buf = k_cache.new_empty((rows * max(spans), *k_cache.shape[1:]))  # (rows*NB, bs, KVH, D)
    v_buf = v_cache.new_empty(k_buf.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(0, len(lens), rows):
        e = s + rows
        n_blocks = max(spans[s:e])
        if any(firsts[s:e]):
            first = torch.tensor(firsts[s:e], device=block_tables.device)
            idx = (first[:, None] + torch.arange(n_blocks, device=block_tables.device)).clamp_(max=block_tables.shape[1] - 1)
            pages = block_tables[s:e].gather(1, idx).reshape(-1).long()  # pages past a sequence's end: masked
            key_start = first.to(q.device) * bs
        else:
            pages, key_start = block_tables[s:e, :n_blocks].reshape(-1).long(), None  # (r*NB,)
        k = torch.index_select(k_cache, 0, pages, out=k_buf[: pages.numel()])
        v = torch.index_select(v_cache, 0, pages, out=v_buf[: pages.numel()])
        k, v = kv_quant.readable(k, q.dtype), kv_quant.readable(v, q.dtype)  # a quantized cache: its gathered pages unpacked
        out[s:e] = _decode_chunk(q[s:e], k, v, seq_lens[s:e], scale, window, softcap, key_start)
    return out


_GATHER_BYTES = 4 << 20


def _rows_per_chunk(k_cache, max_len: int) -> int:
    bytes_per_seq = -(-max_len // k_cache.shape[1]) * k_cache[0].numel() * k_cache.element_size()
    return max(1, _GATHER_BYTES // bytes_per_seq)


def _decode_chunk(q, k_pages, v_pages, seq_lens, scale: float, window: int = 0, softcap: float = 0.0,
                  key_start: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, D) against each sequence's gathered pages k_pages, v_pages (B*NB, bs, KVH, D),
    whose first key sits at position key_start (B,) (None: 0); window > 0: each sees only its
    last `window` keys.

    Slots past a sequence's length are masked but still read: a cache must hold finite values
    everywhere (allocate it with torch.zeros), since sdpa computes 0 * NaN = NaN.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    k = k_pages.view(batch, -1, kv_heads, head_dim).transpose(1, 2)  # (B, KVH, NB*bs, D)
    v = v_pages.view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    if key_start is not None:
        key_pos = key_pos + key_start[:, None]
    valid = key_pos < seq_lens[:, None]  # (B, NB*bs)
    if window > 0:
        valid &= key_pos >= seq_lens[:, None] - window
    if softcap:
        return eager(q[:, :, None], k, v, scale, valid[:, None, None, :], softcap)[:, :, 0]
    # GQA by folding each KV head's query group into sdpa's query-length axis: no K/V repeat,
    # and faster than enable_gqa on CPU.
    q = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # (B, KVH, group, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


def varlen_per_sequence(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, window: int = 0,
                        softcap: float = 0.0):
    """Any mix of query lengths: one gather and one sdpa per sequence."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        k, v = gather_pages(k_cache, v_cache, block_tables[i], seq_len, window_page(seq_len, q_end - q_start, window, k_cache.shape[1]),
                            q.dtype)
        out[q_start:q_end] = attend_one(q[q_start:q_end], k, v, scale, window, softcap)
    return out


def window_page(seq_len: int, q_len: int, window: int, block_size: int) -> int:
    """The first page the q_len queries ending at seq_len read: the one holding the first
    query's oldest key in its window (0 without one; the pages before may be freed)."""
    return max(0, seq_len - q_len - window + 1) // block_size if window > 0 else 0


def gather_pages(k_cache, v_cache, block_table, seq_len: int, first_page: int = 0, dtype: torch.dtype = torch.float32):
    """K and V of one sequence's positions first_page * block_size..seq_len-1, each (S, KVH, D),
    read page by page (a quantized cache's unpacked to dtype). attend_one takes them as they
    are: its masks are relative to the last key."""
    n_blocks = -(-seq_len // k_cache.shape[1])
    pages = block_table[first_page:n_blocks].long()
    n = seq_len - first_page * k_cache.shape[1]
    k = kv_quant.readable(k_cache.index_select(0, pages).flatten(0, 1)[:n], dtype)
    return k, kv_quant.readable(v_cache.index_select(0, pages).flatten(0, 1)[:n], dtype)


def attend_one(q, k, v, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q (L, H, D) against k, v (S, KVH, D), query j at position S - L + j; returns (L, H, D).

    Laid out as transformers' Llama sdpa call: (1, heads, len, D) views, is_causal only when
    L > 1 and there is no cached prefix, no mask at all for a single query token. With a window
    shorter than S: a single query reads only the last `window` keys (transformers' sliding
    cache), longer queries take the bottom-right causal mask narrowed to the window.
    """
    q_len, heads = q.shape[0], q.shape[1]
    seq_len, kv_heads = k.shape[0], k.shape[1]
    windowed = 0 < window < seq_len
    if windowed and q_len == 1:  # the last `window` keys, unmasked
        k, v, seq_len, windowed = k[seq_len - window:], v[seq_len - window:], window, False
    q4 = q.unsqueeze(0).transpose(1, 2)  # (1, H, L, D)
    k4, v4 = _kv_heads_for_sdpa(k, v, heads // kv_heads)  # (1, KVH or H, S, D)
    kwargs = {"enable_gqa": True} if _SDPA_HAS_GQA and heads != kv_heads else {}
    if softcap:
        mask = _bottom_right_causal(q_len, seq_len, q.device, window if windowed else 0)
        return eager(q4, k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2), scale, mask, softcap)[0].transpose(0, 1)
    if q_len == seq_len and not windowed:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=q_len > 1, scale=scale, **kwargs)
    elif q_len == 1:
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, **kwargs)
    else:
        mask = _bottom_right_causal(q_len, seq_len, q.device, window if windowed else 0)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, **kwargs)
    return out[0].transpose(0, 1)


def attend_fresh(q, k, v, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """n prompts of one length L with no cached prefix, in one causal sdpa call: q (n, L, H, D),
    k, v (n, L, KVH, D) (any strides with contiguous heads: views of the fused qkv rows, so no
    page is read back); returns (n, L, H, D). attend_one per prompt is its twin: the same sdpa
    over each batch element. window > 0 and < L: the causal mask narrowed to the window."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q4 = q.transpose(1, 2)  # (n, H, L, D)
    k4, v4 = k.transpose(1, 2), v.transpose(1, 2)
    if softcap:
        mask = _bottom_right_causal(q.shape[1], q.shape[1], q.device, window if 0 < window < q.shape[1] else 0)
        return eager(q4, k4, v4, scale, mask, softcap).transpose(1, 2)
    if not _SDPA_HAS_GQA and heads != kv_heads:
        k4, v4 = k4.repeat_interleave(heads // kv_heads, dim=1), v4.repeat_interleave(heads // kv_heads, dim=1)
    kwargs = {"enable_gqa": True} if _SDPA_HAS_GQA and heads != kv_heads else {}
    length = q.shape[1]
    if 0 < window < length:
        mask = _bottom_right_causal(length, length, q.device, window)
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, **kwargs).transpose(1, 2)
    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, **kwargs).transpose(1, 2)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (cap 0: x), in transformers' op order: Gemma 2's attention scores and logits."""
    return torch.tanh(x / cap) * cap if cap else x


def eager(q4, k4, v4, scale: float, allowed, softcap: float = 0.0) -> torch.Tensor:
    """Attention as transformers' eager_attention_forward computes it: q4 (B, H, L, D) against
    k4, v4 (B, KVH, S, D) (each KV head repeated for its query group), scores times scale,
    soft-capped (softcap > 0: s -> softcap * tanh(s / softcap)), masked where `allowed`
    (boolean, broadcast to (B, H, L, S)) is False, float32 softmax, then the values; (B, H, L, D).
    The twin of the sdpa calls above where there is no soft-cap; the only path where there is."""
    group = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(q4, k4.transpose(2, 3)) * scale, softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q4.dtype)
    return torch.matmul(probs, v4)


def _kv_heads_for_sdpa(k, v, group: int):
    """(S, KVH, D) -> (1, KVH, S, D), repeated to (1, H, S, D) only where sdpa lacks enable_gqa."""
    k4, v4 = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    if _SDPA_HAS_GQA or group == 1:
        return k4, v4
    return k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)


def _bottom_right_causal(q_len: int, seq_len: int, device, window: int = 0) -> torch.Tensor:
    """Boolean (L, S): query j (at position p = S - L + j) may see keys 0..p (window > 0: p - window + 1..p)."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    return allowed & (k_pos > q_pos - window) if window > 0 else allowed
