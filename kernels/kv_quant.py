"""The quantized KV cache's rows: vLLM's --kv-cache-dtype (auto, int8, fp8 / fp8_e4m3) as pool storage.

Layout: a quantized pool keeps the float pool's shape (layers, 2, blocks, block_size, KVH, W)
with W = D + 4: each (token, KV head) row of K (and of V) holds its D codes, then the 4 bytes of
its float32 scale. So the scale is per token and head, not per block: as accurate as a scale can
be, and a block filled one token at a time never needs re-scaling. Because the scales sit inside
the block, every hand-off back-end (shm, tcp) moves a block's scales with its codes unchanged,
and one dtype name (KVAccept.kv_dtype: int8, float8_e4m3fn) tells two workers' pools apart.
Bytes per token and head: D + 4 instead of 4 D in float32 (3.76x the blocks at D = 64, 3.88x at
D = 128) or 2 D in bfloat16.
  int8: scale = amax / 127, code = round-half-even(x / scale) (all 0 where amax is 0, scale 0),
        x ~ code * scale, error <= scale / 2 = amax / 254 per element.
  fp8 (torch.float8_e4m3fn): scale = amax / 448 (e4m3's largest finite), code = x / scale
        rounded to e4m3 (nearest even): relative error <= 2^-4 per element.
Who reads it: kernels.paged.write_kv quantizes (`pack`); kernels.torch_paged and
kernels.reference dequantize the pages they gather (`readable`); the C kernels
(kernels/csrc/cpu_ops.c pd_rope_write_kv_q8, pd_paged_decode_attention_q8; step_ops.c) write and
read int8 with the same arithmetic (`C_READABLE`); fp8 takes the torch path on the CPU. The
Triton kernels read neither: a quantized cache on CUDA is refused (EngineConfig, kernels.paged).

Lifecycle: stateless; `storage_dtype` / `row_width` size a pool once (runtime.kv_cache,
EngineConfig.blocks_for_budget), `pack` runs at every KV write, `readable` at every gather.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # --kv-cache-dtype (vLLM's names; fp8 is fp8_e4m3)
SCALE_BYTES = 4  # a row's float32 scale
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest code of each storage dtype
C_READABLE = (torch.float32, torch.int8)  # what the C decode kernels read (fp8: the torch path)


class KVCacheDtypeError(ValueError):
    """An unknown --kv-cache-dtype, or one this device's attention does not read."""


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype: the model's for auto, else int8 or float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise KVCacheDtypeError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a pool of this dtype: D, or D codes + the scale's bytes."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """D of a cache whose last dim is row_width(D, its dtype)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache.dtype) else 0)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV bytes one token holds in a pool of this dtype (every layer, K and V, every head, scales included)."""
    return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales (..., 1) of quantized rows (..., D + 4), a view."""
    return rows[..., -SCALE_BYTES:].view(torch.float32)


def pack(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float rows x (..., D) as quantized rows (..., D + 4) of dtype (see the module docstring)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / QUANT_MAX[dtype]
    scaled = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    if dtype == torch.int8:
        out[..., :-SCALE_BYTES] = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    else:
        out[..., :-SCALE_BYTES] = scaled.to(dtype)
    scales(out).copy_(scale)
    return out


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows (..., D + 4) as values (..., D): code * scale in float32, then dtype."""
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def readable(pages: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pages as attention reads them: float pages as they are, quantized ones unpacked to dtype."""
    return unpack(pages, dtype) if is_quantized(pages.dtype) else pages


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte dtype tensor as uint8 (a view), for the ops torch lacks on float8 (index_copy_)."""
    return t.view(torch.uint8) if is_quantized(t.dtype) else t
