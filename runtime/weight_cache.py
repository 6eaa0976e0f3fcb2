"""One copy of a model's re-laid-out weights per node: files made once, mapped read-only by every worker.

Lifecycle: runtime.weights opens `WeightCache.for_model(gguf_path)` when it loads a GGUF keeping
its blocks (keep_quantized), and gives every quantized tensor an origin in it
(kernels.quant.Origin). What the loader, the model and the CPU kernels make of those blocks
(the llama arch's un-permuted Q/K rows, q/k/v and gate/up joined, a MoE layer's gate and up stacks
joined, the 16-row interleaved GEMV copy of kernels/csrc/gemv16_ops.c) is asked of `get(key,
shape, make)`: the first process of the node to ask makes it, writes it to a temporary file in
the model's directory and renames it into place under an exclusive flock of that directory, so
two workers starting at once never both write one file nor read a half-written one; every process
then maps the file read-only (PROT_READ, MAP_SHARED: a write into the tensor would fault) and the
node's workers share its pages. The mapping lives as long as the tensor that views it.

Files: `<root>/<model id>/<sha256 of key>.bin`, root `$PDSERVE_WEIGHT_CACHE` (a directory; `off`
or `0` turns the cache off: private copies, as before), else `$PDSERVE_CACHE/packed` or
~/.cache/pdserve/packed; the model id hashes the GGUF's resolved path, size, mtime, inode and
LAYOUT_VERSION (bump it when a re-layout's format changes). A file is a HEADER-byte header
(magic, version, sha256 of its key, payload length, crc32 of the payload) then the payload; one
that is short, of another key or version, or whose crc32 disagrees is logged and rebuilt, never
served. Opening a model's cache removes the directories of models whose file is gone or changed
(`source.json` in each). The directories are made 0700 and used only while they are this user's
and nobody else may write them (as the kernel build cache: docs/security.md); where the cache
cannot be used or written (such a directory, a read-only home, a full disk) the loader goes on
with private copies after one warning.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from pdserve.kernels.native_build import owned_and_private

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
HEADER = 4096  # the payload starts page-aligned
MAGIC = b"PDWCACHE"
_HEAD = struct.Struct("<8sI32sQI")  # magic, version, sha256(key), payload bytes, crc32(payload)


class CacheEntryInvalid(Exception):
    """A cache file that must not be served (short, of another key or version, or corrupt)."""


def cache_root() -> Path | None:
    """The directory model caches live under; None where the cache is off."""
    env = os.environ.get("PDSERVE_WEIGHT_CACHE")
    if env is not None and env.lower() in ("off", "0", ""):
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "packed"


def _identity(path: Path) -> dict:
    st = os.stat(path)
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "layout": LAYOUT_VERSION}


def readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only numpy array (a file map) without copying it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


class WeightCache:
    """One model file's shared re-layouts (kernels.quant.BlockStore). `built` and `mapped` list the
    keys this process made and mapped, for tests and the log."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.built: list[str] = []
        self.mapped: list[str] = []
        self.rebuilt: list[str] = []  # keys whose file was invalid (and made again)
        self.failed = False  # a write failed: private copies from then on

    @classmethod
    def for_model(cls, path: str | os.PathLike) -> WeightCache | None:
        """The cache of the model file at `path`, its directory made; None where the cache is off
        or its directory cannot be made (logged)."""
        root = cache_root()
        if root is None:
            return None
        ident = _identity(Path(path))
        name = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            directory = root / name
            if not owned_and_private(root, directory=True):
                raise PermissionError(f"{root} is not this user's alone (owner or group/world write)")
            _remove_stale(root, keep=name)
            directory.mkdir(mode=0o700, exist_ok=True)
            if not owned_and_private(directory, directory=True):
                raise PermissionError(f"{directory} is not this user's alone (owner or group/world write)")
            if not (directory / "source.json").is_file():
                _write_atomic(directory, "source.json", json.dumps(ident).encode())
        except OSError as e:
            log.warning("weight cache off: cannot use %s (%s); each worker keeps its own copy of the re-laid-out weights", root, e)
            return None
        return cls(directory)

    def file_of(self, key: str) -> Path:
        return self.dir / f"{hashlib.sha256(key.encode()).hexdigest()}.bin"

    def get(self, key: str, shape: tuple[int, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The uint8 tensor `shape` stored under `key`, mapped read-only from this node's file;
        made by `make()` and written first by whichever process asks first."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        if self.failed:
            return make()
        path = self.file_of(key)
        try:
            got = self._map_valid(path, key, nbytes)
            if got is None:
                with self._locked():
                    got = self._map_valid(path, key, nbytes, quiet=True)  # another process may have made it meanwhile
                    if got is None:
                        data = make()
                        if data.dtype != torch.uint8 or data.numel() != nbytes:
                            raise ValueError(f"weight cache: {key} made {data.dtype} {tuple(data.shape)}, expected uint8 {shape}")
                        self._write(path, key, data)
                        self.built.append(key)
                        got = self._map(path, key, nbytes)
        except OSError as e:
            log.warning("weight cache: cannot write %s (%s); private copies from here on", self.dir, e)
            self.failed = True
            return make()
        self.mapped.append(key)
        return got.reshape(shape)

    def _map_valid(self, path: Path, key: str, nbytes: int, quiet: bool = False) -> torch.Tensor | None:
        """The file's payload, or None where it is absent or invalid (logged once)."""
        try:
            return self._map(path, key, nbytes)
        except FileNotFoundError:
            return None
        except CacheEntryInvalid as e:
            if not quiet:
                log.warning("weight cache: %s is invalid (%s): rebuilding it", path.name, e)
                self.rebuilt.append(key)
            return None

    @staticmethod
    def _map(path: Path, key: str, nbytes: int) -> torch.Tensor:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != HEADER + nbytes:
                raise CacheEntryInvalid(f"{size} bytes, expected {HEADER + nbytes}")
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        magic, version, digest, length, crc = _HEAD.unpack_from(mm, 0)
        if (magic, version, digest, length) != (MAGIC, LAYOUT_VERSION, hashlib.sha256(key.encode()).digest(), nbytes):
            raise CacheEntryInvalid("header of another key, version or length")
        payload = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=HEADER)
        if zlib.crc32(payload) != crc:
            raise CacheEntryInvalid("crc32 of the payload disagrees")
        return readonly_tensor(payload)

    def _write(self, path: Path, key: str, data: torch.Tensor) -> None:
        payload = data.contiguous().numpy()
        head = _HEAD.pack(MAGIC, LAYOUT_VERSION, hashlib.sha256(key.encode()).digest(), payload.nbytes, zlib.crc32(payload))
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head.ljust(HEADER, b"\0"))
                f.write(memoryview(payload).cast("B"))
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename: a crash leaves the old name or the whole file, and the
                # mapping that follows reads clean pages (smaps counted unwritten-back pages as the mapper's dirty ones)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / ".lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_atomic(directory: Path, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)


def _remove_stale(root: Path, keep: str) -> None:
    """Remove the caches of model files that are gone or changed since (their source.json says)."""
    for d in root.iterdir():
        if d.name == keep or not d.is_dir():
            continue
        try:
            ident = json.loads((d / "source.json").read_text())
        except (OSError, ValueError):
            continue  # being made (source.json comes second), or not ours: left alone
        try:
            current = _identity(Path(ident["path"]))
        except FileNotFoundError:
            current = None
        except (OSError, KeyError, TypeError):
            continue
        if current != ident:
            shutil.rmtree(d, ignore_errors=True)
