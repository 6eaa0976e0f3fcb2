"""A fast reader of a GGUF file's header: metadata and tensor table, with tensor bytes mapped.

Lifecycle: `read_gguf(path)` parses the header once (strings of the embedded vocabulary are
skipped, not decoded, which is what makes it much faster than gguf.GGUFReader: docs/performance.md,
"Figures behind design choices"), maps the file read-only, and returns metadata plus a `GGUFTensor` per tensor
whose `raw()` is a zero-copy uint8 view of its bytes shaped (rows, bytes per row). Type sizes
and dequantization come from the `gguf` package. A file that ends early or lies about its
sizes raises ValueError naming what is wrong.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    qtype: GGMLQuantizationType
    data: np.ndarray  # uint8 view (rows, bytes per row)


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"file ends inside the header (at byte {self.pos})")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, decode: bool = True):
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes runs past the end of the file")
        s = bytes(self.buf[self.pos:self.pos + n]) if decode else None
        self.pos += n
        return s.decode("utf-8", errors="replace") if decode else None

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(keep)
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if keep:
                return [self.value(etype, True) for _ in range(n)]
            if etype in _SCALARS:
                self.pos += n * struct.calcsize(_SCALARS[etype])
            else:
                for _ in range(n):
                    self.value(etype, False)
            return None
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf(path: str, keep=lambda key: not key.startswith("tokenizer.ggml.") or key.endswith("_id")):
    """(metadata, tensors) of a GGUF file; metadata keys failing `keep` are skipped."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    if c.take("<4s") != b"GGUF":
        raise ValueError("bad magic: not a GGUF file")
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        vtype = c.take("<I")
        want = keep(key)
        v = c.value(vtype, want)
        if want:
            meta[key] = v
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        qtype = GGMLQuantizationType(c.take("<I"))
        infos.append((name, dims, qtype, c.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    return meta, [_tensor(data, start, *info) for info in infos]


def _tensor(data: np.ndarray, start: int, name: str, dims, qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise ValueError(f"tensor {name}: row of {dims[0]} is not a whole number of {qtype.name} blocks")
    row_bytes = dims[0] // block * type_size
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    lo = start + offset
    hi = lo + rows * row_bytes
    if hi > len(data):
        raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
    return GGUFTensor(name, dims, qtype, data[lo:hi].reshape(rows, row_bytes))
