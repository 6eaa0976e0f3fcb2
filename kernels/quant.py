"""GGUF block-quantized weights kept as they are (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K,
Q5_K, Q6_K), their matmul and their twin.

Lifecycle: runtime.weights wraps each quantized 2-D tensor of a GGUF file in a `QuantTensor`
(its bytes a read-only view of the file map with an `Origin` in the node's weight cache, or
copied out of the map where the cache is off; rows in the file's order), and each 3-D expert stack
of a mixture of experts in a `QuantExperts` (expert e's matrix: a QuantTensor viewing its slice),
when asked to keep weights quantized; the model fuses q/k/v and gate/up by concatenating rows (`QuantTensor.cat`);
what is made of blocks that have an origin (take_rows, cat, `derived`: the kernels' re-layouts)
is made once per node in the origin's store (runtime.weight_cache) and mapped read-only from there;
kernels.linear.PackedLinear then multiplies with `matmul` for the life of the process, and the
embedding lookup reads rows with `rows_float`. `dequantize` is the slow, obvious twin: the same
values gguf's numpy dequantizer gives, in plain torch; the float32 model built from it is what
the tests compare the quantized one with.

Blocks (32 weights each), as llama.cpp writes them:
  Q4_0 (18 bytes): fp16 d, 16 bytes of 4-bit codes   w = d * (q - 8)
  Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of codes  w = d * q + m
  Q5_0 (22 bytes): fp16 d, 4 bytes qh, 16 bytes of codes           w = d * (q - 16)
  Q5_1 (24 bytes): fp16 d, fp16 m, 4 bytes qh, 16 bytes of codes   w = d * q + m
  Q8_0 (34 bytes): fp16 d, 32 int8 codes              w = d * q
Low nibbles hold weights 0..15 of a block, high nibbles 16..31; Q5's fifth bit of weight j is
bit j of qh (little-endian uint32). Super-blocks of 256 weights (the K-quants; llama.cpp's
ggml-common.h), eight sub-blocks of 32 (Q6_K: sixteen of 16) with their own scales:
  Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins mn (packed, see
      _k_scale_min), 128 bytes of nibbles (byte 32c + l: weight l of sub-block 2c low, of 2c + 1
      high)                                                         w = d * sc * q - dmin * mn
  Q5_K (176 bytes): as Q4_K with 32 bytes qh after the scales (bit i of qh[l]: the fifth bit of
      weight l of sub-block i)
  Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per
      16 weights), fp16 d                                           w = d * sc * (q - 32)
(llama-quantize writes Q5_0 / Q5_1 where a K-quant was asked for and rows are not a multiple of
256.) Every one of them is multiplied from its blocks by the C kernels (kernels/csrc/quant_ops.c;
also in the one-call decode step, step_ops.c); the Triton CUDA kernel (kernels.triton_quant)
takes Q4_0 / Q4_1 / Q8_0 only (TRITON_QTYPES), and runtime.engine dequantizes the others at load
on CUDA. Other GGUF types (I-quants, ...) are dequantized to float at load, as before.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

# name -> (ggml type id, bytes per block); a block is 32 weights, a K-quant's 256 (block_weights)
QTYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q5_0": (6, 22), "Q5_1": (7, 24), "Q8_0": (8, 34),
          "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
K_QTYPES = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256 weights
TRITON_QTYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types kernels.triton_quant multiplies (CUDA); the others are dequantized there
BLOCK = 32  # weights in a block (K-quants: in a sub-block); activations are rounded per BLOCK (K-quants at <= K256_ROWS rows: per SUPER_BLOCK)
SUPER_BLOCK = 256
DIRECT_ROWS = 128  # float / int8 activations: up to this many rows the C kernel runs; above, dequantize + MKL (prefill sizes)
ANY_ROWS = 1 << 62
# rows up to which the C kernel rounds activations to integers (quant_ops.c): int8 in small decode
# steps only; int16 at every row count (above 7 rows, quant_ops.c q_gemm: 1.1-1.2x dequantize + MKL at
# prompt sizes, 1.3-1.5x the float tiled kernel at 32-64 rows)
DIRECT_INT_ROWS = {"int8": 4, "int16": ANY_ROWS}
# The K-quants at up to K256_ROWS rows (a lone stream's decode step; quant_ops.c QK256_ROWS) take
# their integer activations with one scale per 256-wide super-block instead of per 32 (int8:
# llama.cpp's q8_K), so that the sub-block scales are applied in integers (quantize_activations,
# matmul_int_twin; takes_k256), except where the 16-row GEMV takes the weight (AVX-512 VNNI, int16:
# per 32 at every row count, 1.7x faster on Q4_K at one row)
K256_ROWS = 4


def block_weights(qtype: str) -> int:
    """Weights in one block of `qtype` (the unit a row's bytes come in)."""
    return SUPER_BLOCK if qtype in K_QTYPES else BLOCK


def row_bytes(qtype: str, cols: int) -> int:
    return cols // block_weights(qtype) * QTYPES[qtype][1]


def kernel_rows(activations: str) -> int:
    """The most rows the C kernel takes for these activations (more: dequantize + F.linear)."""
    return max(DIRECT_ROWS, DIRECT_INT_ROWS.get(activations, 0))


class BlockStore(Protocol):
    """Where re-laid-out blocks live (runtime.weight_cache.WeightCache: a node's shared files)."""

    def get(self, key: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The uint8 tensor `shape` stored under `key` (read-only), made by `make()` where absent."""


@dataclass(frozen=True)
class Origin:
    """Where a matrix's bytes come from, so that what is made of them is made once per node:
    `key` names them in `store` (a GGUF tensor's name, or how they were made of others, e.g.
    `cat(rows(blk.0.attn_q.weight,…),…)`); a view of rows of another matrix names that `parent`
    and its first row `row0` (a re-layout local to groups of rows is then a slice of the parent's)."""

    store: BlockStore
    key: str
    parent: QuantTensor | None = None
    row0: int = 0


def _index_digest(index: torch.Tensor) -> str:
    return hashlib.sha256(index.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class QuantTensor:
    """A (out, in) weight matrix as rows of GGUF blocks: raw is (out, in / 32 * block bytes) uint8.
    `origin` (runtime.weights with the weight cache): raw is a read-only map of the GGUF or of a
    cache file, and what take_rows / cat / derived make of it is made once per node (Origin)."""

    raw: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    origin: Origin | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.qtype not in QTYPES:
            raise ValueError(f"{self.qtype} is not a natively served quant type ({', '.join(QTYPES)})")
        rows, cols = self.shape
        if cols % block_weights(self.qtype) or self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (rows, row_bytes(self.qtype, cols)):
            raise ValueError(f"{self.qtype} bytes {tuple(self.raw.shape)} do not hold a {self.shape} matrix")
        if not self.raw.is_contiguous():
            raise ValueError("QuantTensor rows must be contiguous")

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def type_id(self) -> int:
        return QTYPES[self.qtype][0]

    def take_rows(self, index: torch.Tensor) -> QuantTensor:
        """The matrix of rows `index` (a row permutation or selection; rows are independent): a
        copy, made once per node where the matrix has an origin (its store keeps it)."""
        shape = (index.numel(), self.raw.shape[1])
        if self.origin is None:
            return QuantTensor(self.raw.index_select(0, index).contiguous(), self.qtype, (shape[0], self.shape[1]))
        key = f"rows({self.origin.key},{_index_digest(index)})"
        raw = self.origin.store.get(key, shape, lambda: self.raw.index_select(0, index).contiguous())
        return QuantTensor(raw, self.qtype, (shape[0], self.shape[1]), Origin(self.origin.store, key))

    def row_slice(self, start: int, stop: int) -> QuantTensor:
        """Rows start..stop as a view of these bytes (nothing copied)."""
        origin = None if self.origin is None else Origin(self.origin.store, f"{self.origin.key}[{start}:{stop}]", self, start)
        return QuantTensor(self.raw[start:stop], self.qtype, (stop - start, self.shape[1]), origin)

    @staticmethod
    def cat(parts: list) -> QuantTensor | None:
        """Rows of several matrices stacked (q/k/v, gate/up); None unless all are QuantTensors of
        one type and width (a Q4_K_M file's q/k/v mix Q4_K and Q6_K in some layers: the model
        then keeps them side by side, runtime.model.MixedBlocks). Consecutive row slices of one
        matrix (a fused qkv split at load) join back into a view of it; parts that all have an
        origin in one store are joined once per node (the store's copy); others are copied."""
        if not all(isinstance(p, QuantTensor) for p in parts) or len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            return None
        qtype, cols, rows = parts[0].qtype, parts[0].shape[1], sum(p.shape[0] for p in parts)
        origins = [p.origin for p in parts]
        if all(o is not None for o in origins):
            parent, start = origins[0].parent, origins[0].row0
            if parent is not None and all(o.parent is parent for o in origins) \
                    and all(o.row0 == start + sum(q.shape[0] for q in parts[:i]) for i, o in enumerate(origins)):
                return parent.row_slice(start, start + rows)
            store = origins[0].store
            if all(o.store is store for o in origins):
                key = f"cat({','.join(o.key for o in origins)})"
                raw = store.get(key, (rows, parts[0].raw.shape[1]), lambda: torch.cat([p.raw for p in parts]))
                return QuantTensor(raw, qtype, (rows, cols), Origin(store, key))
        return QuantTensor(torch.cat([p.raw for p in parts]), qtype, (rows, cols))

    def derived(self, kind: str, make: Callable[[QuantTensor], torch.Tensor], row_group: int = 0,
                shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A re-layout of these bytes (`make(self)`: a uint8 tensor shaped like raw, or `shape`, a row
        of it per weight row; kernels.cpu_native's 16-row GEMV copy), made once and kept on this matrix for its
        life; with an origin, made once per node into its store and mapped from there. row_group:
        the re-layout is local to groups of that many rows, so that of a view of a parent's rows
        (Origin.parent: an expert of a stack, a part of a fused matrix) is a slice of the parent's."""
        out = self.__dict__.get("_" + kind)  # (QuantTensor is frozen: kept in its __dict__)
        if out is not None:
            return out
        o, rows = self.origin, self.shape[0]
        if o is None:
            out = make(self)
        elif o.parent is not None and row_group and not (o.row0 % row_group or rows % row_group or o.parent.shape[0] % row_group):
            whole = o.parent.derived(kind, make, row_group, None if shape is None else (o.parent.shape[0], *shape[1:]))
            out = whole[o.row0:o.row0 + rows]
        else:
            out = o.store.get(f"{kind}({o.key})", tuple(shape or self.raw.shape), lambda: make(self))
        self.__dict__["_" + kind] = out
        return out

    def dequantize(self) -> torch.Tensor:
        """The twin: every weight as float32, the values gguf.quants.dequantize gives."""
        return dequantize_raw(self.raw, self.qtype, self.shape[1])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32 in plain torch, on the blocks' device (the twin of rows_float)."""
        return dequantize_raw(self.raw.index_select(0, index.reshape(-1)), self.qtype, self.shape[1])

    def rows_float(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32 (an embedding lookup), through the C kernel when it is built."""
        from pdserve.kernels import cpu_native

        ops = cpu_native.native()
        if ops is None:
            return self.rows(index)
        return ops.q_dequant(self, index.reshape(-1).to(torch.int64).contiguous())


@dataclass(frozen=True)
class QuantExperts:
    """A mixture of experts' stack of E (rows, cols) matrices in GGUF blocks, as a GGUF stores
    ffn_{gate,up,down}_exps: raw is (E, rows, row bytes) uint8, expert e's matrix `expert(e)` a
    QuantTensor viewing its slice (no copy), so a kernel given it reads that expert's bytes only."""

    raw: torch.Tensor
    qtype: str
    shape: tuple[int, int, int]
    origin: Origin | None = field(default=None, compare=False, repr=False)  # as QuantTensor's

    def __post_init__(self):
        experts, rows, cols = self.shape
        if self.qtype not in QTYPES:
            raise ValueError(f"{self.qtype} is not a natively served quant type ({', '.join(QTYPES)})")
        if cols % block_weights(self.qtype) or self.raw.dtype != torch.uint8 \
                or tuple(self.raw.shape) != (experts, rows, row_bytes(self.qtype, cols)) or not self.raw.is_contiguous():
            raise ValueError(f"{self.qtype} bytes {tuple(self.raw.shape)} do not hold a contiguous {self.shape} expert stack")

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def expert(self, e: int) -> QuantTensor:
        """Expert e's matrix, a view of its bytes (with an origin: rows of the stack's `as_rows`)."""
        if self.origin is None:
            return QuantTensor(self.raw[e], self.qtype, self.shape[1:])
        return self.as_rows().row_slice(e * self.shape[1], (e + 1) * self.shape[1])

    def as_rows(self) -> QuantTensor:
        """The stack as one (E * rows, cols) matrix of the same bytes (one object for its life)."""
        whole = self.__dict__.get("_rows")
        if whole is None:
            e, rows, cols = self.shape
            whole = QuantTensor(self.raw.reshape(e * rows, -1), self.qtype, (e * rows, cols), self.origin)
            self.__dict__["_rows"] = whole
        return whole

    @staticmethod
    def cat(parts: list) -> QuantExperts | None:
        """Each expert's rows of several stacks stacked (gate then up); None unless all are
        QuantExperts of one type and width (then the caller keeps them apart). Stacks that all
        have an origin in one store are joined once per node (the store's copy)."""
        if not all(isinstance(p, QuantExperts) for p in parts) or len({(p.qtype, p.shape[0], p.shape[2]) for p in parts}) != 1:
            return None
        e, rows, cols = parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].shape[2]
        origins = [p.origin for p in parts]
        if all(o is not None for o in origins) and all(o.store is origins[0].store for o in origins):
            store, key = origins[0].store, f"cat_experts({','.join(o.key for o in origins)})"
            raw = store.get(key, (e, rows, parts[0].raw.shape[2]), lambda: torch.cat([p.raw for p in parts], dim=1))
            return QuantExperts(raw, parts[0].qtype, (e, rows, cols), Origin(store, key))
        raw = torch.cat([p.raw for p in parts], dim=1)
        return QuantExperts(raw, parts[0].qtype, (e, rows, cols))

    def dequantize(self) -> torch.Tensor:
        """The twin: every expert's weights as float32, (E, rows, cols)."""
        e, rows, cols = self.shape
        return dequantize_raw(self.raw.reshape(e * rows, -1), self.qtype, cols).reshape(e, rows, cols)


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian fp16 bytes -> (..., 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _q5_codes(b: torch.Tensor) -> torch.Tensor:
    """A Q5 block's codes 0..31 (uint8, 32 wide) from its 4 bytes qh and 16 bytes of nibbles."""
    qh = b[..., 0:4].to(torch.int64)
    bits = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
    high = ((bits.unsqueeze(-1) >> torch.arange(32)) & 1).to(torch.uint8)
    nib = b[..., 4:20]
    return torch.cat([nib & 15, nib >> 4], dim=-1) | high << 4


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 packed bytes -> eight 6-bit scales and mins (uint8 each): j < 4: the low
    6 bits of bytes j and j + 4; j >= 4: byte j + 4's nibbles below the top two bits of bytes
    j - 4 (scale) and j (min)."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | (a >> 6) << 4], dim=-1)
    mn = torch.cat([b & 63, (c >> 4) | (b >> 6) << 4], dim=-1)
    return sc, mn


def k_subblocks(raw: torch.Tensor, qtype: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K-quant matrix as (codes (rows, cols) int16, scales (rows, cols / 16) float32, offsets
    (rows, cols / 32) float32) with w[j] = scale[j // 16] * codes[j] + offset[j // 32], the form
    the C kernels take (quant_ops.c qk_unpack): Q4_K / Q5_K scale d * sc (both halves of a
    sub-block alike), offset -(dmin * mn), codes q; Q6_K scale d * sc, codes q - 32, offset 0."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // SUPER_BLOCK, QTYPES[qtype][1])
    if qtype == "Q6_K":
        ql, qh = blocks[..., 0:128].reshape(rows, -1, 2, 64), blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
        d = _half(blocks[..., 208:210])
        scale = d * blocks[..., 192:208].contiguous().view(torch.int8).float()  # (rows, nsb, 16)
        low = torch.cat([ql & 15, ql >> 4], dim=-1).reshape(rows, -1, 2, 4, 32)  # weight 32k + l of each half
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3
        codes = (low | high << 4).to(torch.int16) - 32
        return codes.reshape(rows, cols), scale.reshape(rows, -1), torch.zeros(rows, cols // BLOCK)
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, mn = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 48:176] if qtype == "Q5_K" else blocks[..., 16:144]
    qs = qs.reshape(rows, -1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(rows, -1, 8, 32)  # sub-block 2c low, 2c + 1 high
    if qtype == "Q5_K":
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)
        codes = codes | ((qh >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1) << 4
    scale = d * sc.float()  # (rows, nsb, 8)
    offset = -(dmin * mn.float())
    return codes.to(torch.int16).reshape(rows, cols), scale.repeat_interleave(2, -1).reshape(rows, -1), offset.reshape(rows, -1)


def dequantize_raw(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """(rows, cols) float32 from rows of blocks, in plain torch: gguf's values, bit for bit."""
    rows = raw.shape[0]
    if qtype in K_QTYPES:
        codes, scale, offset = k_subblocks(raw, qtype, cols)
        w = scale.unsqueeze(-1) * codes.float().reshape(rows, -1, 16)  # (d * sc) * q, as gguf rounds it
        if qtype != "Q6_K":
            w = w.reshape(rows, -1, BLOCK) + offset.unsqueeze(-1)  # ... - dmin * mn
        return w.reshape(rows, cols)
    blocks = raw.reshape(rows, cols // BLOCK, QTYPES[qtype][1])
    d = _half(blocks[..., 0:2])  # (rows, nb, 1)
    if qtype == "Q8_0":
        q = blocks[..., 2:34].contiguous().view(torch.int8).float()
        w = d * q
    elif qtype in ("Q5_0", "Q5_1"):
        q = _q5_codes(blocks[..., 4:24] if qtype == "Q5_1" else blocks[..., 2:22]).float()
        w = d * q + _half(blocks[..., 2:4]) if qtype == "Q5_1" else d * (q - 16)
    else:
        codes = blocks[..., 4:20] if qtype == "Q4_1" else blocks[..., 2:18]
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float()
        if qtype == "Q4_1":
            w = d * q + _half(blocks[..., 2:4])
        else:
            w = d * (q - 8)
    return w.reshape(rows, cols)


def matmul(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, activations: str = "float") -> torch.Tensor:
    """x (M, K) float32 @ w^T: the C kernel up to kernel_rows(activations) rows, else dequantize and
    F.linear. activations "int16" / "int8": up to DIRECT_INT_ROWS rows are rounded to integers per
    32-wide block first and multiplied in integers (faster; matmul_int_twin is what they compute)."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    if ops is None or x.shape[0] > kernel_rows(activations):
        return F.linear(x, w.dequantize() if ops is None else ops.q_dequant(w), bias)
    out = ops.q_matmul(x, w, activations)
    return out if bias is None else out.add_(bias)


def bound_matmul(w: QuantTensor, activations: str = "float"):
    """The C kernel bound to one weight (kernels.cpu_native.NativeOps.q_linear): x -> x @ w^T for
    at most kernel_rows(activations) rows; None without the C kernels (callers then use `matmul`)."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    return None if ops is None else ops.q_linear(w, activations)


def matmul_twin(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(), bias)


INT_LIMITS = {"int8": 127.0, "int16": 32767.0}  # the largest code of each integer activation kind


def quantize_activations(x: torch.Tensor, kind: str = "int8", width: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer paths' activations: (codes (M, K), scales dx (M, K/width), block sums (M, K/32)),
    x ~ dx * codes per `width`-wide block with dx = max|x| / L (L = 127 for int8, 32767 for
    int16), rounded half to even. width SUPER_BLOCK: the K-quants' few-row form (quant_ops.c
    qk256_activations; int8 is llama.cpp's q8_K, whose int8 sums of each 16 codes, Q6_K's offset
    taken in integers, are the codes' own sums: the twin needs none)."""
    rows, cols = x.shape
    limit = INT_LIMITS[kind]
    blocks = x.reshape(rows, cols // width, width)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8 if kind == "int8" else torch.int16)
    return codes.reshape(rows, cols), amax / limit, x.reshape(rows, cols // BLOCK, BLOCK).sum(-1)


def int_form(w: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w as the integer paths take it: (codes (N, K) int, scales (N, K / 16) float64, offsets
    (N, K / 32) float64) with w[j] = scale[j // 16] * codes[j] + offset[j // 32] (the C kernels'
    q_block_head / qk_unpack: Q4_0 / Q5_0 unsigned codes with offset -8 d / -16 d, Q8_0 signed
    codes, Q6_K signed codes q - 32 with a scale per 16 weights, the rest a scale per 32)."""
    n, cols = w.shape
    if w.qtype in K_QTYPES:
        codes, scale, offset = k_subblocks(w.raw, w.qtype, cols)
        return codes, scale.double(), offset.double()
    blocks = w.raw.reshape(n, cols // BLOCK, QTYPES[w.qtype][1])
    d = blocks[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)  # (N, nb)
    if w.qtype == "Q8_0":
        q, m = blocks[..., 2:34].contiguous().view(torch.int8), torch.zeros_like(d)
    elif w.qtype in ("Q5_0", "Q5_1"):
        q = _q5_codes(blocks[..., 4:24] if w.qtype == "Q5_1" else blocks[..., 2:22])
        m = blocks[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1) if w.qtype == "Q5_1" else -16 * d
    else:
        codes = blocks[..., 4:20] if w.qtype == "Q4_1" else blocks[..., 2:18]
        q = torch.cat([codes & 15, codes >> 4], dim=-1)
        m = blocks[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1) if w.qtype == "Q4_1" else -8 * d
    return q.reshape(n, cols).to(torch.int16), d.repeat_interleave(2, -1), m


def takes_k256(w: QuantTensor, rows: int, kind: str) -> bool:
    """Whether the C kernel rounds `rows` rows of x per 256 (K256_ROWS) rather than per 32: the K-quants' few rows,
    except with int16 activations on a weight the 16-row GEMV takes (kernels.cpu_native gemv16_copy: AVX-512 VNNI,
    rows a multiple of 16), which rounds per 32 at every row count."""
    if not (kind in INT_LIMITS and w.qtype in K_QTYPES and rows <= K256_ROWS):
        return False
    from pdserve.kernels import cpu_native

    ops = cpu_native.native()
    return not (kind == "int16" and ops is not None and ops.has_gemv16 and w.shape[0] % 16 == 0)


def matmul_int_twin(x: torch.Tensor, w: QuantTensor, kind: str = "int8") -> torch.Tensor:
    """What the C kernel's integer paths (up to DIRECT_INT_ROWS rows) compute, in float64: per
    block of activations (32 wide; the K-quants' few-row case, takes_k256: 256, quant_ops.c
    qk16_rows_* / qk8_rows_avx2 / qk256_row_scalar) dx * sum over its 16-wide groups of scale *
    (codes . xq), plus offset * sum(x) per 32 (int_form: Q6_K's codes q - 32). Its difference from
    `matmul_twin` is the activations' rounding to int8 or int16, which is the price of those paths."""
    rows, cols = x.shape
    width = SUPER_BLOCK if takes_k256(w, rows, kind) else BLOCK
    xq, dx, xsum = quantize_activations(x, kind, width)
    q, scale, m = int_form(w)
    groups = cols // 16
    dots = torch.einsum("ngj,mgj->mng", q.double().reshape(-1, groups, 16), xq.reshape(rows, groups, 16).double())  # exact integers
    dxg = dx.double().repeat_interleave(width // 16, -1)  # (M, groups)
    return (dots * scale.unsqueeze(0) * dxg.unsqueeze(1)).sum(-1) + xsum.double() @ m.T
