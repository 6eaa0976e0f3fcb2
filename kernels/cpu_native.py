"""The fused float32 CPU kernels of kernels/csrc/cpu_ops.c, and their torch twins.

Lifecycle: `native()` builds the C file once per machine (cc -O3 -march=native -fopenmp, about
a second) into a cache directory (`$PDSERVE_CACHE` or ~/.cache/pdserve; the file name carries
a hash of the source, the compiler and the CPU, so a stale build is never loaded), loads it with
ctypes and returns the same `NativeOps` for the life of the process; it returns None, after one
warning, where no C compiler is found or the build fails, and callers then run the twins. The
library is linked against the OpenMP runtime torch already loaded, so both share one thread pool
and the thread count set by torch.set_num_threads.

Each op takes torch tensors, checks what the C side relies on (float32, CPU, strides), and calls
C with raw pointers; ctypes drops the GIL for the call. `*_twin` functions compute the same in
plain torch and are what tests compare the kernels with.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
_lock = threading.Lock()
_loaded: list = []  # [NativeOps | None] once tried


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(compiler: str) -> Path:
    """Compile cpu_ops.c unless an identical build is cached; returns the .so path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join(
        [_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(), _cpu_signature().encode(), sys.platform.encode()]
    )).hexdigest()[:16]
    target = cache_dir() / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name, then rename: concurrent workers never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def native() -> "NativeOps | None":
    """The loaded kernels, built on first use; None (warned once) where they cannot be built."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> "NativeOps | None":
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the fused CPU kernels are off, the torch twins run instead")
        return None
    try:
        return NativeOps(ctypes.CDLL(str(build(compiler))))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("building the fused CPU kernels failed (%s %s): the torch twins run instead", e, detail[-2000:])
        return None


_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


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


class NativeOps:
    """Typed entry points over the loaded library."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.pd_paged_decode_attention.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _I, _I, _I, _I, _I, _F]
        lib.pd_paged_decode_attention.restype = _I
        lib.pd_rms_norm.argtypes = [_P, _I64, _P, _P, _P, _I, _I, _F]
        lib.pd_rms_norm.restype = None
        lib.pd_silu_mul.argtypes = [_P, _P, _I, _I]
        lib.pd_silu_mul.restype = None
        lib.pd_rope_write_kv.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I]
        lib.pd_rope_write_kv.restype = None

    def decode_attention(self, q, out, rows, k_cache, v_cache, block_tables, seq_lens, scale: float) -> None:
        """out[rows[b]] = attention of query row q[rows[b]] (H*D wide) over sequence b's pages.

        q, out: (T, >= H*D) float32 with contiguous rows; rows: (B,) int64; k_cache, v_cache:
        (num_blocks, BS, KVH, D) contiguous; block_tables: (B, W) int32; seq_lens: (B,) int32.
        """
        _check_rows(q, "q")
        _check_rows(out, "out")
        _check(k_cache, "k_cache")
        _check(v_cache, "v_cache")
        _check(rows, "rows", torch.int64)
        _check(block_tables, "block_tables", torch.int32)
        _check(seq_lens, "seq_lens", torch.int32)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
            raise ValueError("k_cache and v_cache must be contiguous and of one shape")
        if not (rows.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1):
            raise ValueError("rows, seq_lens and block table rows must be contiguous")
        _, bs, kvh, d = k_cache.shape
        batch = rows.numel()
        heads = out.shape[1] // d
        if seq_lens.numel() != batch or block_tables.shape[0] != batch or heads % kvh or q.shape[1] < heads * d:
            raise ValueError("decode_attention: rows, seq_lens, block_tables and head counts disagree")
        failed = self.lib.pd_paged_decode_attention(
            _ptr(q), q.stride(0), _ptr(out), out.stride(0), _ptr(rows), _ptr(k_cache), _ptr(v_cache),
            _ptr(block_tables), block_tables.stride(0), _ptr(seq_lens), batch, heads, kvh, d, bs, scale,
        )
        if failed:
            raise MemoryError("decode_attention: scratch allocation failed")

    def rms_norm(self, x, weight, out, eps: float, residual=None) -> None:
        """out = RMSNorm(x) * weight; with residual: residual += x first, and normalise that."""
        _check_rows(x, "x")
        _check(weight, "weight")
        _check(out, "out")
        rows, dim = x.shape
        if not out.is_contiguous() or out.shape != (rows, dim) or weight.shape != (dim,):
            raise ValueError("rms_norm: out must be contiguous (rows, dim) and weight (dim,)")
        if residual is not None:
            _check(residual, "residual")
            if not residual.is_contiguous() or residual.shape != (rows, dim):
                raise ValueError("rms_norm: residual must be contiguous (rows, dim)")
        self.lib.pd_rms_norm(_ptr(x), x.stride(0), None if residual is None else _ptr(residual), _ptr(weight), _ptr(out), rows, dim, eps)

    def silu_mul(self, gate_up, out) -> None:
        """out (rows, I) = silu(gate_up[:, :I]) * gate_up[:, I:]."""
        _check(gate_up, "gate_up")
        _check(out, "out")
        rows, inter = out.shape
        if not (gate_up.is_contiguous() and out.is_contiguous()) or gate_up.shape != (rows, 2 * inter):
            raise ValueError("silu_mul: gate_up must be contiguous (rows, 2*I) and out (rows, I)")
        self.lib.pd_silu_mul(_ptr(gate_up), _ptr(out), rows, inter)

    def rope_write_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int) -> None:
        """Rotate q and k of the fused qkv rows in place, then store k and v at their slots."""
        _check_rows(qkv, "qkv")
        for t, n in ((cos, "cos"), (sin, "sin"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            _check(t, n)
            if not t.is_contiguous():
                raise ValueError(f"rope_write_kv: {n} must be contiguous")
        _check(positions, "positions", torch.int64)
        _check(slots, "slots", torch.int64)
        d = cos.shape[1]
        tokens = qkv.shape[0]
        if qkv.shape[1] != (heads + 2 * kv_heads) * d or k_cache.shape[-2:] != (kv_heads, d):
            raise ValueError("rope_write_kv: qkv width, cache shape and head counts disagree")
        if positions.shape != (tokens,) or slots.shape != (tokens,) or not (positions.is_contiguous() and slots.is_contiguous()):
            raise ValueError("rope_write_kv: positions and slots must be contiguous (T,)")
        self.lib.pd_rope_write_kv(
            _ptr(qkv), qkv.stride(0), _ptr(positions), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), _ptr(slots),
            tokens, heads, kv_heads, d,
        )


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
