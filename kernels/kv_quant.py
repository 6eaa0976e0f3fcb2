"""The quantized KV cache's rows: vLLM's --kv-cache-dtype (auto, int8, fp8 / fp8_e4m3) as pool storage.

Layout: a quantized pool keeps the float pool's shape (layers, 2, blocks, block_size, KVH, W)
with W = D + 4: each (token, KV head) row of K (and of V) holds its D codes, then 4 bytes of
metadata. So the quantization is per token and head, not per block: a block filled one token at
a time never needs re-scaling. Because the metadata sits inside the block, every hand-off
back-end (shm, tcp) and the host tier move a block's scales with its codes unchanged, and one
dtype name (KVAccept.kv_dtype: uint8 for int8, float8_e4m3fn for fp8) tells two workers' pools
apart. Bytes per token and head: D + 4 instead of 4 D in float32 (3.76x the blocks at D = 64,
3.88x at D = 128) or 2 D in bfloat16.

  int8 (pool dtype torch.uint8; since 2026-12-08, issue 41): the row is first rotated by the
  Sylvester Hadamard matrix H (entries +-1, H H = D I) where D is a power of two, y = H x (D
  adds and subtracts a stage, log2 D butterfly stages: `hadamard`); for another D, y = x (no
  rotation). The rotation spreads a row's outliers over all its channels, so one scale fits the
  row far better. y is then stored as asymmetric 8-bit codes: scale s = max((max y - min y) /
  255, |min y| / 32000) rounded to float16 (clamped to [2^-24, 65504]; 0 only for a row of
  zeros), zero code z = round(-min y / s) (int16), code c = clamp(round(y / s) + z, 0, 255),
  y ~ s (c - z), error <= s / 2 per element of y (up to about 5 s / 8 at the top of the range,
  which the float16 rounding of s may leave short). Bytes D..D+3: s's float16 bits, then z (int16,
  little-endian). Reading undoes the rotation: x ~ H (s (c - z)) / D. The integer zero code
  keeps the fp16 scale's rounding a scaling of the row by (1 + e), |e| <= 2^-11, not an offset
  (a float16 offset cost the greedy agreement; float32 scale and offset, W = D + 8, were no
  better than this form: docs/performance.md, "Quantized KV cache").
  Before 2026-12-08 int8 rows were symmetric and unrotated (torch.int8 codes, a float32 scale
  amax / 127): the pool dtype changed with the layout, so a worker of an older build and one of
  this build refuse each other's blocks at the hand-off (dtype names int8 vs uint8), and the
  host tier's fingerprint (which names the dtype) keeps their tiers apart.
  fp8 (torch.float8_e4m3fn, unrotated: rotation did not help it, docs/performance.md): scale =
  amax / 448 (e4m3's largest finite) as float32 in bytes D..D+3, code = x / scale rounded to
  e4m3 (nearest even): relative error <= 2^-4 per element.
Attention over rotated rows: q.k = (H q).(H k) / D, so a reader may rotate the query instead of
every key (the C kernels: q -> H q / D once per head, scores against s (c - z), and the weighted
sum of the V rows s (c - z) rotated back by H / D once at the end); kernels.torch_paged and
kernels.reference unpack the gathered pages to float rows instead (`readable`).
Who reads it: kernels.paged.write_kv quantizes (`pack`); kernels.torch_paged and
kernels.reference dequantize the pages they gather (`readable`); the C kernels
(kernels/csrc/cpu_ops.c pd_rope_write_kv_q8, pd_paged_decode_attention_q8; step_ops.c) write and
read int8 with the same arithmetic (`C_READABLE`; the C write is `pack` bit for bit); fp8 takes
the torch path on the CPU. The Triton kernels read neither: a quantized cache on CUDA is refused
(EngineConfig, kernels.paged).

Lifecycle: stateless; `storage_dtype` / `row_width` size a pool once (runtime.kv_cache,
EngineConfig.blocks_for_budget), `pack` runs at every KV write, `readable` at every gather.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # --kv-cache-dtype (vLLM's names; fp8 is fp8_e4m3)
INT8 = torch.uint8  # the int8 form's pool dtype: asymmetric codes 0..255 (module docstring)
FP8 = torch.float8_e4m3fn
META_BYTES = 4  # after a row's D codes: int8's float16 scale and int16 zero code, or fp8's float32 scale
QUANT_MAX = {INT8: 255.0, FP8: 448.0}  # the largest code of each storage dtype
C_READABLE = (torch.float32, INT8)  # what the C decode kernels read (fp8: the torch path)
ZERO_LIMIT = 32000.0  # s >= |min y| / ZERO_LIMIT keeps the zero code within int16
HALF_MAX, HALF_TINY = 65504.0, 2.0 ** -24  # float16's largest finite and smallest positive (subnormal)


class KVCacheDtypeError(ValueError):
    """An unknown --kv-cache-dtype, or one this device's attention does not read."""


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype: the model's for auto, else uint8 (int8's codes) or float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return INT8
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8
    raise KVCacheDtypeError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def rotated(head_dim: int) -> bool:
    """Whether int8 rows of this head dim are stored Hadamard-rotated: D a power of two (> 1)."""
    return head_dim > 1 and head_dim & (head_dim - 1) == 0


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a pool of this dtype: D, or D codes + the 4 metadata bytes."""
    return head_dim + META_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """D of a cache whose last dim is row_width(D, its dtype)."""
    return cache.shape[-1] - (META_BYTES if is_quantized(cache.dtype) else 0)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV bytes one token holds in a pool of this dtype (every layer, K and V, every head, metadata included)."""
    return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last dim (a power of two D) for the Sylvester matrix H (+-1 entries, H H = D I),
    by butterflies in float32: stage h = 1, 2, .. D / 2 maps each pair (a, b) of elements h apart to
    (a + b, a - b). The C write (cpu_ops.c hadamard) does the same float operations: `pack`'s twin."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), -2)
        h *= 2
    return y.reshape(*lead, d)


_H: dict = {}


def _unrotation(d: int, device) -> torch.Tensor:
    """H / D as a (D, D) float32 matrix (H symmetric, so rows @ it is H row / D for each row)."""
    key = (d, str(device))
    if key not in _H:
        _H[key] = hadamard(torch.eye(d, device=device)) / d
    return _H[key]


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales (..., 1) of quantized rows (..., D + 4) (a copy for int8's float16 scales)."""
    meta = rows[..., -META_BYTES:]
    if rows.dtype == INT8:
        return meta.view(torch.int16)[..., :1].view(torch.float16).float()
    return meta.view(torch.float32)


def zero_codes(rows: torch.Tensor) -> torch.Tensor:
    """The int16 zero codes (..., 1) of int8 rows (..., D + 4), a view."""
    return rows[..., -META_BYTES:].view(torch.int16)[..., 1:]


def pack(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float rows x (..., D) as quantized rows (..., D + 4) of dtype (see the module docstring)."""
    x = x.float()
    out = torch.empty((*x.shape[:-1], x.shape[-1] + META_BYTES), dtype=dtype, device=x.device)
    if dtype == INT8:
        y = hadamard(x) if rotated(x.shape[-1]) else x
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        s = torch.maximum((hi - lo) / 255, lo.abs() / ZERO_LIMIT).clamp(max=HALF_MAX)
        s16 = torch.where((s > 0) & (s.half() == 0), HALF_TINY, s).half()  # a scale under float16's range: its smallest
        sf = s16.float()
        safe = torch.where(sf > 0, sf, 1.0)
        z = torch.where(sf > 0, torch.round(-lo / safe), 0.0).clamp(-32768, 32767)
        codes = torch.where(sf > 0, torch.round(y / safe) + z, 0.0).clamp(0, 255)
        out[..., :-META_BYTES] = codes.to(torch.uint8)
        meta = out[..., -META_BYTES:].view(torch.int16)
        meta[..., :1] = s16.view(torch.int16)
        meta[..., 1:] = z.to(torch.int16)
        return out
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / QUANT_MAX[dtype]
    scaled = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    out[..., :-META_BYTES] = scaled.to(dtype)
    out[..., -META_BYTES:].view(torch.float32).copy_(scale)
    return out


def unpack(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows (..., D + 4) as values (..., D) in float32, then dtype: int8's s (c - z)
    rotated back (H / D) where D is a power of two; fp8's code * scale."""
    if rows.dtype == INT8:
        d = rows.shape[-1] - META_BYTES
        y = (rows[..., :-META_BYTES].int() - zero_codes(rows).int()).float() * scales(rows)
        return (y @ _unrotation(d, rows.device) if rotated(d) else y).to(dtype)
    return (rows[..., :-META_BYTES].float() * scales(rows)).to(dtype)


def readable(pages: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pages as attention reads them: float pages as they are, quantized ones unpacked to dtype."""
    return unpack(pages, dtype) if is_quantized(pages.dtype) else pages


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte dtype tensor as uint8 (a view), for the ops torch lacks on float8 (index_copy_)."""
    return t.view(torch.uint8) if is_quantized(t.dtype) else t
