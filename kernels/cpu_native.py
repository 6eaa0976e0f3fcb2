"""The fused float32 CPU kernels of kernels/csrc (cpu_ops.c, quant_ops.c, gemv16_ops.c, step_ops.c), and their torch twins.

Lifecycle: `native()` loads the C library once per process and returns the same `NativeOps` for
the life of the process. The sources are compiled once per instruction-set level
(kernels/native_build.py: `baseline` x86-64, `avx2` = x86-64-v3, `avx512` = x86-64-v4 + VNNI),
each into its own library with the same symbols; the baseline one's pd_cpu_features says what
the CPU *and* the OS support (cpuid and the XSAVE state the OS enables), and native() loads the
best variant they allow, or the one `PDSERVE_ISA` names (a lower one: tests run every variant on
one machine; a variant the CPU cannot run is refused with ValueError). The libraries are those
the install step built (setup.py, into kernels/_native); where none is installed, or the
installed ones were built from other sources (an editable checkout edited since), each variant
needed is built on first use into a cache directory (`$PDSERVE_CACHE` or ~/.cache/pdserve), and
where no C compiler is found native() returns None after one warning and callers run the twins.
`load(isa)` gives one variant's NativeOps (cached), `usable_isas()` the variants this machine
runs, best first: a back-end selector times them as separate back-ends. Every library is linked
against the OpenMP runtime, so the thread count torch.set_num_threads set applies.

Each op takes torch tensors, checks what the C side relies on (float32, CPU, strides), and calls
C with raw pointers; ctypes drops the GIL for the call. `*_twin` functions compute the same in
plain torch and are what tests compare the kernels with.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels import kv_quant, native_build

log = logging.getLogger(__name__)

_lock = threading.RLock()
_loaded: dict = {}  # isa -> NativeOps | None once tried; "" -> the one native() returns
CPU_FEATURES = {"avx2": 1, "avx512": 2, "avx512_bf16": 4, "amx": 8}  # pd_ops.h PD_CPU_* bits
ISA_NEEDS = {"baseline": 0, "avx2": 1, "avx512": 2}  # the PD_CPU_* bit each variant needs


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "kernels"


class NotBuilt(RuntimeError):
    """A variant could not be had: no compiler, or its build failed."""


def _library_path(isa: str) -> Path:
    """The installed library of this variant if it was built from these sources, else a cached build."""
    installed = native_build.INSTALLED / native_build.library_name(isa)
    if installed.exists() and _built_from_these_sources(installed):
        return installed
    cc = native_build.compiler()
    if cc is None:
        raise NotBuilt("no C compiler found and no installed kernels (pip install builds them)")
    try:
        return native_build.cached_build(cc, isa, cache_dir())
    except (OSError, subprocess.SubprocessError) as e:
        raise NotBuilt(f"building the {isa} kernels failed ({e} {(getattr(e, 'stderr', '') or '')[-2000:]})") from e


def _built_from_these_sources(lib: Path) -> bool:
    if not all((native_build.CSRC / s).exists() for s in native_build.SOURCES):
        return True  # the sources were not shipped: the installed build is all there is
    fn = ctypes.CDLL(str(lib)).pd_source_hash
    fn.restype = ctypes.c_char_p
    fresh = fn().decode() == native_build.source_hash()
    if not fresh:
        log.info("%s was built from other sources than kernels/csrc now holds: building them instead", lib)
    return fresh


def _library(isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_library_path(isa)))
    if lib.pd_build_isa() != native_build.ISA_LEVEL[isa]:
        raise NotBuilt(f"the {isa} library was compiled for level {lib.pd_build_isa()}")
    return lib


def cpu_features() -> set[str]:
    """What the CPU and the OS let this process run (CPU_FEATURES names), from the baseline library."""
    bits = load("baseline").lib.pd_cpu_features()
    return {name for name, bit in CPU_FEATURES.items() if bits & bit}


def usable_isas() -> list[str]:
    """The variants this machine runs, best first (baseline always last); [] without the kernels."""
    if load("baseline") is None:
        return []
    bits = load("baseline").lib.pd_cpu_features()
    return [isa for isa in native_build.platform_isas() if bits & ISA_NEEDS[isa] == ISA_NEEDS[isa] and load(isa) is not None]


def load(isa: str) -> NativeOps | None:
    """One variant's kernels (cached per process); None, warned once, where they cannot be built.
    Callers must check the CPU runs it (usable_isas) before calling into it."""
    native_build.isa_flags(isa)  # ValueError for an unknown name
    with _lock:
        if isa not in _loaded:
            try:
                _loaded[isa] = NativeOps(_library(isa), isa)
            except (OSError, NotBuilt) as e:
                log.warning("the fused CPU kernels (%s) are off, the torch twins run instead: %s", isa, e)
                _loaded[isa] = None
        return _loaded[isa]


def native() -> NativeOps | None:
    """The best variant this machine runs, or the one PDSERVE_ISA names; None (warned once) where
    the kernels cannot be built or PDSERVE_NATIVE_KERNELS=0."""
    with _lock:
        if "" not in _loaded:
            _loaded[""] = _choose()
        return _loaded[""]


def _choose() -> NativeOps | None:
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    usable = usable_isas()
    forced = os.environ.get("PDSERVE_ISA")
    if forced:
        native_build.isa_flags(forced)  # ValueError for an unknown name
        if forced not in usable:
            raise ValueError(f"PDSERVE_ISA={forced}: this CPU and OS run only {', '.join(usable) or 'no native kernels'}")
        chosen = forced
    else:
        chosen = usable[0] if usable else None
    if chosen is not None:
        log.info("fused CPU kernels: the %s variant (this machine runs %s)", chosen, ", ".join(usable))
    return None if chosen is None else load(chosen)


_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name -> (result, arguments) of every function of csrc/pd_ops.h, in its order
_SIGNATURES = {
    "pd_cpu_features": (_I, []),
    "pd_build_isa": (_I, []),
    "pd_source_hash": (ctypes.c_char_p, []),
    "pd_paged_decode_attention": (_I, [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _I, _I, _I, _I, _I, _F, _I]),
    "pd_rms_norm": (None, [_P, _I64, _P, _P, _P, _I, _I, _F]),
    "pd_silu_mul": (None, [_P, _P, _I, _I]),
    "pd_rope_write_kv": (None, [_P, _I64, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "pd_rope_write_kv_q8": (None, [_P, _I64, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "pd_paged_decode_attention_q8": (_I, [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _I, _I, _I, _I, _I, _F, _I]),
    "pd_q_dequant": (None, [_P, _I64, _I, _I, _P, _I, _P]),
    "pd_q_matmul": (_I, [_P, _I64, _P, _I64, _I, _I, _I, _I, _P, _I64, _I]),
    "pd_f_matmul": (_I, [_P, _I64, _P, _I, _I, _I, _P, _I64]),
    "pd_q_gemm_i8": (_I, [_P, _I64, _P, _I64, _I, _I, _I, _I, _P, _I64]),
    "pd_q_repack16": (_I, [_P, _I64, _I, _I, _I, _P]),
    "pd_q_gemv16": (_I, [_P, _I64, _P, _I, _I, _I, _I, _P, _I64]),
    "pd_peak_loop": (_I64, [_I, _I64, _I, _P]),
    "pd_decode_layers": (_I, [_P, _I, _P, _I64, _I64, *[_P] * 8, _I, *[_P] * 6, _I64, _P, _I, _I, _I, _I, _I, _I, _F, _F, _I, _I]),
}


GEMV16_ROWS = 128  # pd_ops.h PD_GEMV16_ROWS: the rows gemv16_ops.c pd_q_gemv16 takes
GEMV16_QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the types gemv16_ops.c repacks (the others run pd_q_matmul's int16 path)
# bytes a row's 32 weights take in the copy (gemv16_ops.c g_row_block_bytes): the GGUF block's, or for Q5_K / Q6_K
# float32 scale and offset (Q6_K: two scales) and a byte a code; Q4_K keeps the file's scales (a row's super-block:)
GEMV16_ROW_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_K": 40, "Q6_K": 40}
GEMV16_ROW_SUPER_BYTES = {"Q4_K": 148}  # Q4_K: a row's super-block (its fp16 d and dmin, 8 x (sc, mn, 16 nibble bytes))
ACTIVATION_MODES = {"float": 0, "int8": 1, "int16": 2}  # quant_ops.c ACT_*: how a small decode batch meets quantized weights


PEAK_KINDS = {"fp32": 0, "int16": 1, "int8": 2}  # peak_ops.c kinds


def activation_mode(activations: str) -> int:
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {activations!r}")
    return ACTIVATION_MODES[activations]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _check(t: torch.Tensor, name: str, dtype=torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")


def _check_rows(t: torch.Tensor, name: str) -> None:
    """A (rows, width) float32 matrix whose rows are contiguous (any row stride)."""
    _check(t, name)
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with contiguous rows, got shape {tuple(t.shape)} strides {t.stride()}")


def _bound_linear(name: str, n: int, k: int, call):
    """A callable (x, out=None) -> x @ W^T for an (n, k) weight whose C call is call(x, out)
    (nonzero: scratch allocation failed): x is checked, out allocated or checked."""

    def run(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.device.type != "cpu":
            raise ValueError(f"{name}: x must be a CPU float32 (M, {k}) matrix with contiguous rows")
        if out is None:
            out = torch.empty((x.shape[0], n), dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (x.shape[0], n) or not out.is_contiguous():
            raise ValueError(f"{name}: out must be a contiguous float32 ({x.shape[0]}, {n}) matrix")
        if x.shape[0] and call(x, out):
            raise MemoryError(f"{name}: scratch allocation failed")
        return out

    return run


class NativeOps:
    """Typed entry points over the loaded library."""

    def __init__(self, lib: ctypes.CDLL, isa: str):
        self.lib = lib
        self.isa = isa  # the variant loaded (native_build.ISAS)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        # the 16-row GEMV (gemv16_ops.c) is built in this variant: asked with no rows, it answers 0
        self.has_gemv16 = lib.pd_q_gemv16(None, 32, None, 3, 0, 16, 32, None, 16) == 0

    def decode_attention(self, q, out, rows, k_cache, v_cache, block_tables, seq_lens, scale: float, check: bool = True,
                         window: int = 0) -> None:
        """out[rows[b]] = attention of query row q[rows[b]] (H*D wide) over sequence b's pages
        (window > 0: over its last `window` keys only; kernels.paged's sliding window).

        q, out: (T, >= H*D) float32 with contiguous rows; rows: (B,) int64; k_cache, v_cache:
        (num_blocks, BS, KVH, D) float32 or an int8 cache's (num_blocks, BS, KVH, D + 4) uint8 rows
        (kernels.kv_quant: Hadamard-rotated where D is a power of two), contiguous; block_tables: (B, W) int32; seq_lens: (B,) int32.
        """
        int8 = k_cache.dtype == kv_quant.INT8
        if check:  # the step's first layer checks; the rest pass the same tensors' siblings
            _check_rows(q, "q")
            _check_rows(out, "out")
            _check(k_cache, "k_cache", kv_quant.INT8 if int8 else torch.float32)
            _check(v_cache, "v_cache", k_cache.dtype)
            _check(rows, "rows", torch.int64)
            _check(block_tables, "block_tables", torch.int32)
            _check(seq_lens, "seq_lens", torch.int32)
            if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
                raise ValueError("k_cache and v_cache must be contiguous and of one shape")
            if not (rows.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1):
                raise ValueError("rows, seq_lens and block table rows must be contiguous")
        _, bs, kvh, d = k_cache.shape
        d -= kv_quant.META_BYTES if int8 else 0
        batch = rows.numel()
        heads = out.shape[1] // d
        if check and (seq_lens.numel() != batch or block_tables.shape[0] != batch or heads % kvh or q.shape[1] < heads * d):
            raise ValueError("decode_attention: rows, seq_lens, block_tables and head counts disagree")
        failed = (self.lib.pd_paged_decode_attention_q8 if int8 else self.lib.pd_paged_decode_attention)(
            _ptr(q), q.stride(0), _ptr(out), out.stride(0), _ptr(rows), _ptr(k_cache), _ptr(v_cache),
            _ptr(block_tables), block_tables.stride(0), _ptr(seq_lens), batch, heads, kvh, d, bs, scale, window,
        )
        if failed:
            raise MemoryError("decode_attention: scratch allocation failed")

    def rms_norm(self, x, weight, out, eps: float, residual=None, check: bool = True) -> None:
        """out = RMSNorm(x) * weight; with residual: residual += x first, and normalise that."""
        rows, dim = x.shape
        if check:
            _check_rows(x, "x")
            _check(weight, "weight")
            _check(out, "out")
            if not out.is_contiguous() or out.shape != (rows, dim) or weight.shape != (dim,):
                raise ValueError("rms_norm: out must be contiguous (rows, dim) and weight (dim,)")
            if residual is not None:
                _check(residual, "residual")
                if not residual.is_contiguous() or residual.shape != (rows, dim):
                    raise ValueError("rms_norm: residual must be contiguous (rows, dim)")
        self.lib.pd_rms_norm(_ptr(x), x.stride(0), None if residual is None else _ptr(residual), _ptr(weight), _ptr(out), rows, dim, eps)

    def silu_mul(self, gate_up, out, check: bool = True) -> None:
        """out (rows, I) = silu(gate_up[:, :I]) * gate_up[:, I:]."""
        rows, inter = out.shape
        if check:
            _check(gate_up, "gate_up")
            _check(out, "out")
            if not (gate_up.is_contiguous() and out.is_contiguous()) or gate_up.shape != (rows, 2 * inter):
                raise ValueError("silu_mul: gate_up must be contiguous (rows, 2*I) and out (rows, I)")
        self.lib.pd_silu_mul(_ptr(gate_up), _ptr(out), rows, inter)

    def rope_write_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int, check: bool = True) -> None:
        """Rotate q and k of the fused qkv rows in place, then store k and v at their slots (an
        int8 cache, kernels.kv_quant's rows of D + 4: quantized as kv_quant.pack does)."""
        d = cos.shape[1]
        tokens = qkv.shape[0]
        int8 = k_cache.dtype == kv_quant.INT8
        if check:
            _check_rows(qkv, "qkv")
            cache_dtype = kv_quant.INT8 if int8 else torch.float32
            for t, n, dt in ((cos, "cos", torch.float32), (sin, "sin", torch.float32), (k_cache, "k_cache", cache_dtype),
                             (v_cache, "v_cache", cache_dtype)):
                _check(t, n, dt)
                if not t.is_contiguous():
                    raise ValueError(f"rope_write_kv: {n} must be contiguous")
            _check(positions, "positions", torch.int64)
            _check(slots, "slots", torch.int64)
            if qkv.shape[1] != (heads + 2 * kv_heads) * d or k_cache.shape[-2:] != (kv_heads, kv_quant.row_width(d, k_cache.dtype)):
                raise ValueError("rope_write_kv: qkv width, cache shape and head counts disagree")
            if positions.shape != (tokens,) or slots.shape != (tokens,) or not (positions.is_contiguous() and slots.is_contiguous()):
                raise ValueError("rope_write_kv: positions and slots must be contiguous (T,)")
        (self.lib.pd_rope_write_kv_q8 if int8 else self.lib.pd_rope_write_kv)(
            _ptr(qkv), qkv.stride(0), _ptr(positions), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), _ptr(slots),
            tokens, heads, kv_heads, d,
        )

    def q_matmul(self, x, w, activations: str = "float") -> torch.Tensor:
        """x (M, K) float32 with contiguous rows @ w^T for a kernels.quant.QuantTensor w (N, K);
        activations int16 / int8: up to kernels.quant.DIRECT_INT_ROWS rows are rounded to integers
        first (kernels.quant.matmul_int_twin)."""
        return self.q_linear(w, activations)(x)

    def q_linear(self, w, activations: str = "float"):
        """q_matmul bound to one weight: a callable x -> x @ w^T with the weight's arguments
        computed once and only the input checked per call (the per-layer hot path). With int16
        activations, up to GEMV16_ROWS rows run the 16-row GEMV over the weight's interleaved copy
        where this variant builds it (gemv16: the same bits)."""
        fn, wp, stride, qt, (n, k) = self.lib.pd_q_matmul, w.raw.data_ptr(), w.raw.stride(0), w.type_id, w.shape
        i8 = activation_mode(activations)
        w16 = self.gemv16_copy(w) if activations == "int16" else None
        if w16 is None:
            return _bound_linear("q_linear", n, k, lambda x, out: fn(x.data_ptr(), x.stride(0), wp, stride, qt, x.shape[0], n, k, out.data_ptr(), n, i8))
        g, gp = self.lib.pd_q_gemv16, w16.data_ptr()

        def call(x, out):
            if x.shape[0] <= GEMV16_ROWS:
                return g(x.data_ptr(), x.stride(0), gp, qt, x.shape[0], n, k, out.data_ptr(), n)
            return fn(x.data_ptr(), x.stride(0), wp, stride, qt, x.shape[0], n, k, out.data_ptr(), n, i8)

        return _bound_linear("q_linear", n, k, call)

    def gemv16_copy(self, w) -> torch.Tensor | None:
        """The 16-row interleaved copy of a kernels.quant.QuantTensor (gemv16_ops.c
        pd_q_repack16), made once per weight and kept on it (QuantTensor.derived: once per node,
        in the weight cache's shared files, where the weight has an origin); None where this
        variant has no 16-row GEMV, the weight's rows are not a multiple of 16 or its type is not
        one the GEMV takes (GEMV16_QTYPES)."""
        if not self.has_gemv16 or w.shape[0] % 16 or w.qtype not in GEMV16_QTYPES:
            return None
        return w.derived("gemv16", self.repack16, row_group=16, shape=self.gemv16_shape(w))

    @staticmethod
    def gemv16_shape(w) -> tuple[int, int]:
        """The copy's shape: the weight's rows, each its K/32 blocks' bytes in the copy."""
        if w.qtype in GEMV16_ROW_SUPER_BYTES:
            return (w.shape[0], w.shape[1] // 256 * GEMV16_ROW_SUPER_BYTES[w.qtype])
        return (w.shape[0], w.shape[1] // 32 * GEMV16_ROW_BLOCK_BYTES[w.qtype])

    def repack16(self, w) -> torch.Tensor:
        """pd_q_repack16 of a QuantTensor into a new tensor shaped like its bytes."""
        copy = torch.empty(self.gemv16_shape(w), dtype=torch.uint8)
        if self.lib.pd_q_repack16(w.raw.data_ptr(), w.raw.stride(0), w.type_id, w.shape[0], w.shape[1], copy.data_ptr()):
            raise ValueError(f"pd_q_repack16 refused a {w.qtype} {w.shape} weight")
        return copy

    def q_linear_i8_gemm(self, w):
        """x -> x @ w^T for a kernels.quant.QuantTensor w at any row count, activations rounded to
        int8 per 32-wide block (kernels.quant.matmul_int_twin "int8"), by the AVX-512 VNNI GEMM
        (quant_ops.c pd_q_gemm_i8, vpdpbusd); None where this variant does not build it or the
        weight is a K-quant (which it does not take: 3)."""
        fn, wp, stride, qt, (n, k) = self.lib.pd_q_gemm_i8, w.raw.data_ptr(), w.raw.stride(0), w.type_id, w.shape
        if fn(None, k, wp, stride, qt, 0, n, k, None, n) != 0:  # no rows: 0 where the kernel is built and takes the type
            return None
        return _bound_linear("q_linear_i8_gemm", n, k, lambda x, out: fn(x.data_ptr(), x.stride(0), wp, stride, qt, x.shape[0], n, k,
                                                                           out.data_ptr(), n))

    def peak_ops(self, kind: str, iters: int, threads: int) -> tuple[int, float]:
        """(operations, seconds) of `iters` rounds of peak_ops.c's multiply-add loop on `threads`
        threads (kind fp32, int16 or int8; 2 operations per product), seconds the longest CPU
        time a thread took: their ratio is the machine's peak."""
        seconds = ctypes.c_double()
        return self.lib.pd_peak_loop(PEAK_KINDS[kind], iters, threads, ctypes.byref(seconds)), seconds.value

    def f_linear(self, w: torch.Tensor):
        """x -> x @ w^T for a float32 (N, K) weight with contiguous rows, by the tiled kernel of
        quant_ops.c reading w in place (batched decode steps; F.linear is its twin); None where
        that kernel is not built (no AVX2)."""
        if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
            raise ValueError("f_linear: the weight must be a contiguous CPU float32 matrix")
        fn, wp, (n, k) = self.lib.pd_f_matmul, w.data_ptr(), w.shape
        if fn(None, k, wp, 0, n, k, None, n) == 2:  # no rows: 0 where the kernel is built
            return None

        return _bound_linear("f_linear", n, k, lambda x, out: fn(x.data_ptr(), x.stride(0), wp, x.shape[0], n, k, out.data_ptr(), n))

    def decode_layers(self, layers: DecodeLayers, kv_cache, h, x, bufs, positions, slots, rows, block_tables, seq_lens,
                      scale: float, eps: float) -> None:
        """Every decoder layer of a decode-only step in one call (step_ops.c): the per-op loop of
        kernels.cpu_forward, same kernels, same order, so the same bits. h (T, hidden) is the
        residual stream, x layer 0's normalised input; bufs = (qkv, attn, o_out, gate_up, act,
        down), contiguous (T, width) float32; on return down holds the last layer's output.
        T sequences of one query token each: row rows[b] is sequence b's (positions, slots, rows,
        seq_lens (T,), block_tables (T, W), as decode_attention and rope_write_kv take them).
        The pool is checked once per pool (layers.pool_key), the step's tensors every call."""
        qkv, attn, o_out, gate_up, act, down = bufs
        t = h.shape[0]
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype, tuple(kv_cache.stride()))
        int8 = kv_cache.dtype == kv_quant.INT8  # an int8 cache (kernels.kv_quant rows, uint8 codes), else float32
        if layers.pool_key != key:
            _check(kv_cache, "kv_cache", kv_quant.INT8 if int8 else torch.float32)
            if not kv_cache.is_contiguous() or kv_cache.dim() != 6 or kv_cache.shape[0] != layers.count or kv_cache.shape[1] != 2 \
                    or kv_cache.shape[-1] != kv_quant.row_width(layers.cos.shape[1], kv_cache.dtype):
                raise ValueError("decode_layers: kv_cache must be a contiguous (layers, 2, blocks, block size, kv heads, head dim) pool")
            layers.pool_key = key
        for name, m, width in (("h", h, layers.hidden), ("x", x, layers.hidden), ("qkv", qkv, layers.qkv_width), ("attn", attn, layers.q_size),
                               ("o_out", o_out, layers.hidden), ("gate_up", gate_up, 2 * layers.inter), ("act", act, layers.inter),
                               ("down", down, layers.hidden)):
            _check(m, name)
            if not m.is_contiguous() or m.shape != (t, width):
                raise ValueError(f"decode_layers: {name} must be a contiguous ({t}, {width}) matrix")
        pos, tables, lens = positions, block_tables, seq_lens
        for v, n, dt in ((pos, "positions", torch.int64), (slots, "slots", torch.int64), (rows, "rows", torch.int64),
                         (lens, "seq_lens", torch.int32), (tables, "block_tables", torch.int32)):
            _check(v, n, dt)
        if not (pos.shape == slots.shape == rows.shape == lens.shape == (t,)) or tables.shape[0] != t or tables.stride(1) != 1 \
                or not (pos.is_contiguous() and slots.is_contiguous() and rows.is_contiguous() and lens.is_contiguous()):
            raise ValueError("decode_layers: positions, slots, rows, seq_lens (T,) and block_tables (T, W) must be contiguous")
        _, _, _, bs, kvh, _ = kv_cache.shape
        d, size = layers.cos.shape[1], kv_cache.element_size()
        if self.lib.pd_decode_layers(
            layers.array, layers.count, _ptr(kv_cache), kv_cache.stride(0) * size, kv_cache.stride(1) * size, _ptr(h), _ptr(x), _ptr(qkv), _ptr(attn),
            _ptr(o_out), _ptr(gate_up), _ptr(act), _ptr(down), t, _ptr(pos), _ptr(slots), _ptr(layers.cos), _ptr(layers.sin), _ptr(rows),
            _ptr(tables), tables.stride(0), _ptr(lens), layers.heads, kvh, d, bs, layers.hidden, layers.inter, scale, eps, layers.activations,
            int(int8),
        ):
            raise MemoryError("decode_layers: scratch allocation failed")


    def q_dequant(self, w, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (int64, contiguous; None: all) of a QuantTensor as float32."""
        if rows is not None:
            _check(rows, "rows", torch.int64)
            if not rows.is_contiguous() or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= w.shape[0])):
                raise ValueError(f"q_dequant: rows must be contiguous indices in [0, {w.shape[0]})")
        n = w.shape[0] if rows is None else rows.numel()
        out = torch.empty((n, w.shape[1]), dtype=torch.float32)
        self.lib.pd_q_dequant(_ptr(w.raw), w.raw.stride(0), w.type_id, w.shape[1], None if rows is None else _ptr(rows), n, _ptr(out))
        return out


class _QWeight(ctypes.Structure):
    _fields_ = [("w", _P), ("row_bytes", _I64), ("qt", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("w16", _P)]


QKV_PARTS, GATE_UP_PARTS = 3, 2  # pd_ops.h PD_QKV_PARTS, PD_GATE_UP_PARTS: a fused projection's parts of different types


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv_bias", _P), ("qkv", _QWeight * QKV_PARTS), ("o", _QWeight),
                ("gate_up", _QWeight * GATE_UP_PARTS), ("down", _QWeight), ("window", _I64)]


class DecodeLayers:
    """The C description (step_ops.c pd_layer[]) of a model's decoder layers, built once from
    per-layer (input_norm, post_norm, qkv_bias or None, qkv, o, gate_up, down) with the weights
    kernels.quant.QuantTensor (qkv and gate_up: one, or a list of the parts of a fused projection
    whose parts differ in type, each writing its columns: up to QKV_PARTS / GATE_UP_PARTS), and
    the rotary cos / sin tables (positions, head dim); `windows`: each layer's sliding window (0
    or none given: full attention). The tensors are kept referenced for the array's life."""

    def __init__(self, layers: list, heads: int, activations: str, cos: torch.Tensor, sin: torch.Tensor, windows: tuple = ()):
        self.count, self.heads, self.activations = len(layers), heads, activation_mode(activations)
        self._keep = layers
        for v, n in ((cos, "cos"), (sin, "sin")):
            _check(v, n)
            if not v.is_contiguous() or v.shape != cos.shape:
                raise ValueError(f"DecodeLayers: {n} must be a contiguous (positions, head dim) table like cos")
        self.cos, self.sin = cos, sin
        self.pool_key = None  # the KV pool decode_layers last checked
        self.array = (_Layer * len(layers))()
        ops = native()  # the variant decode_layers calls: its 16-row GEMV, if it has one, takes int16 steps of <= GEMV16_ROWS rows
        shapes = set()
        for i, (slot, (in_norm, post_norm, bias, *weights)) in enumerate(zip(self.array, layers)):
            slot.window = windows[i] if windows else 0
            for v, n in ((in_norm, "input_norm"), (post_norm, "post_norm")) + (((bias, "qkv_bias"),) if bias is not None else ()):
                _check(v, n)
                if not v.is_contiguous():
                    raise ValueError(f"DecodeLayers: {n} must be contiguous")
            slot.input_norm, slot.post_norm, slot.qkv_bias = _ptr(in_norm), _ptr(post_norm), None if bias is None else _ptr(bias)
            widths = []
            for name, w, most in zip(("qkv", "o", "gate_up", "down"), weights, (QKV_PARTS, 1, GATE_UP_PARTS, 1)):
                parts = list(w) if isinstance(w, (list, tuple)) else [w]
                if not 1 <= len(parts) <= most or len({p.shape[1] for p in parts}) != 1:
                    raise ValueError(f"DecodeLayers: {name} must be 1 to {most} weights of one input width")
                qweights = [self._qweight(ops, p, activations) for p in parts]
                if most == 1:
                    setattr(slot, name, qweights[0])
                else:
                    for j, q in enumerate(qweights):
                        getattr(slot, name)[j] = q
                widths.append((sum(p.shape[0] for p in parts), parts[0].shape[1]))
            if bias is not None and bias.numel() != widths[0][0]:
                raise ValueError("DecodeLayers: the qkv bias must span every part's columns")
            shapes.add(tuple(widths))
        (qkv, o, gate_up, down), *others = shapes  # (rows, input width) of each projection, summed over its parts
        if others or gate_up != (2 * down[1], o[0]) or down[0] != o[0] or qkv[1] != o[0]:
            raise ValueError("DecodeLayers: the layers' weight shapes disagree")
        self.qkv_width, self.q_size, self.hidden, self.inter = qkv[0], o[1], o[0], down[1]

    @staticmethod
    def _qweight(ops, w, activations: str) -> _QWeight:
        n, k = w.shape
        w16 = ops.gemv16_copy(w) if ops is not None and activations == "int16" else None  # (kept on w: QuantTensor.derived)
        return _QWeight(w.raw.data_ptr(), w.raw.stride(0), w.type_id, n, k, 0, None if w16 is None else w16.data_ptr())


# ------------------------------------------------------------------ torch twins

def rms_norm_twin(x, weight, eps: float, residual=None):
    """(normalised, new residual) as transformers computes them in float32."""
    if residual is not None:
        residual = residual + x
        x = residual
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), residual


def silu_mul_twin(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_twin(x, positions, cos, sin):
    """x (T, heads, D) rotated at positions, transformers' rotate-half form."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
