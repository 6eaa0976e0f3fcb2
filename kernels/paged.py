"""Attention over a paged KV cache: the entry points the model calls once per layer per step.

Lifecycle: stateless. Each step the model first stores the step's new keys/values with
`write_kv`, then calls `paged_attention` for all query tokens of the batch in flattened varlen
form; the call checks shapes and dispatches to a backend: `torch` (kernels.torch_paged, the CPU
production path), `triton` (kernels.triton_paged, imported only on first use so that importing
this package never pulls in triton) or `reference` (kernels.reference, the slow twin the
others are tested against). `auto` means triton for CUDA tensors and torch otherwise. Each
backend switches to its decode specialisation when max_query_len == 1. Every backend takes a
sliding window (`window` > 0: a query at position p sees keys p - window < k <= p, as
transformers masks Mistral's and Qwen2's sliding layers); 0 is full causal attention. A
soft-cap (`softcap` > 0, Gemma 2: scores s -> softcap * tanh(s / softcap) before the softmax) is
taken by `torch` and `reference`; `triton` lacks it and refuses it (NotImplementedError; the
engine refuses such a model on CUDA before building it: runtime.build.check_attention_backend).
A quantized cache (kernels.kv_quant: --kv-cache-dtype int8 / fp8) is quantized by `write_kv` and
read by `torch` and `reference`, which dequantize the pages they gather; `triton` refuses it
(KVCacheDtypeError; EngineConfig refuses the dtype on CUDA first).
"""
from __future__ import annotations

import torch

from . import kv_quant
from .reference import paged_attention_ref
from .torch_paged import paged_attention_torch

BACKENDS = ("auto", "torch", "triton", "reference")


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Store k, v (T, KVH, D) into the pages (num_blocks, block_size, KVH, D) at slot_mapping (T,);
    a quantized cache (kernels.kv_quant: rows of D codes + a scale) stores them quantized."""
    if kv_quant.is_quantized(k_cache.dtype):
        k, v = kv_quant.pack(k, k_cache.dtype), kv_quant.pack(v, v_cache.dtype)
        k_cache, v_cache = kv_quant.as_bytes(k_cache), kv_quant.as_bytes(v_cache)  # torch has no float8 index_copy_
        k, v = kv_quant.as_bytes(k), kv_quant.as_bytes(v)
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape[2:] != v.shape[1:]:
        raise ValueError(f"write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit caches {tuple(k_cache.shape)}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} for {k.shape[0]} tokens")
    slots = slot_mapping.long()
    # view (not reshape) so that a cache that cannot be flattened fails loudly instead of being copied.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))  # (blocks*bs, KVH, D)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    backend: str = "auto",
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of the varlen query tokens q (T, H, D) over their pages; returns (T, H, D).

    Query token j of sequence i sits at position p = seq_lens[i] - q_len_i + j and sees keys
    0..p, or with window > 0 only p - window + 1..p; query head h reads kv head h // (H // KVH).
    softcap > 0: each score s = q.k * scale becomes softcap * tanh(s / softcap) before the softmax.
    """
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window}, {softcap}")
    _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len)
    triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if triton and kv_quant.is_quantized(k_cache.dtype):
        raise kv_quant.KVCacheDtypeError(f"a {k_cache.dtype} KV cache (--kv-cache-dtype int8 / fp8) is not read by the Triton paged "
                                         "attention kernel; the torch and reference backends read it")
    if softcap and triton:
        raise NotImplementedError(f"attention logit soft-capping (Gemma 2) is not supported by the Triton paged attention kernel "
                                f"(backend {backend!r}); the torch and reference backends take it")
    impl = _backend_impl(backend, q)
    if seq_lens.numel() == 0:
        return q.new_empty(q.shape)
    return impl(
        q, k_cache, v_cache,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        max_query_len=max_query_len, scale=scale, window=window, **({"softcap": softcap} if softcap else {}),
    )


def _backend_impl(backend: str, q: torch.Tensor):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "triton":
        from .triton_paged import paged_attention_triton

        return paged_attention_triton
    return paged_attention_torch if backend == "torch" else paged_attention_ref


def _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len: int) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be (T, H, D) and caches (blocks, block_size, KVH, D); got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if kv_quant.head_dim_of(k_cache) != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({kv_quant.head_dim_of(k_cache)}) differ")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if q.dtype != k_cache.dtype and not kv_quant.is_quantized(k_cache.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    batch = seq_lens.numel()
    if query_start_loc.numel() != batch + 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"{batch} sequences need query_start_loc (B+1,) and block_tables (B, max_blocks); "
            f"got {tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}"
        )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
