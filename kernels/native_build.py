"""How the C kernels of kernels/csrc are compiled: the same sources once per instruction-set
level, each into its own shared library with the same symbol names (declared in csrc/pd_ops.h).

Lifecycle: stateless functions, used twice. At install time setup.py (its build_ext step, which
loads this file by path: standard library only, no torch) compiles every variant into
kernels/_native/, so `pip install .`, `pip install -e .` and a wheel carry them; at run time
kernels/cpu_native.py loads those, or, in a source checkout never installed (or one whose
sources changed since: every library records the hash of the sources it was built from), builds
the variants it needs into a cache directory. Nothing here is compiled for the build machine's
own CPU (no -march=native): a variant's flags name an instruction-set level, and cpu_native
picks at load time the best level the CPU and the OS support.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
INSTALLED = Path(__file__).parent / "_native"  # where the install step puts the libraries
SOURCES = ("cpu_ops.c", "quant_ops.c", "gemv16_ops.c", "step_ops.c", "isa_probe.c", "peak_ops.c")
HEADERS = ("pd_ops.h",)
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11")
# best first; each x86-64 level spelled as its feature flags rather than -march=x86-64-v3 / -v4,
# which compilers before GCC 11 / clang 12 do not know. avx512 needs VNNI too (vpdpwssd in the
# int16 GEMM); csrc/isa_probe.c checks the same sets.
_V3 = ("-msse4.2", "-mpopcnt", "-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mmovbe")
X86_FLAGS = {
    "avx512": ("-march=x86-64", "-mtune=generic", *_V3, "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-march=x86-64", "-mtune=generic", *_V3),
    "baseline": ("-march=x86-64", "-mtune=generic"),
}
ISAS = tuple(X86_FLAGS)
ISA_LEVEL = {"baseline": 0, "avx2": 1, "avx512": 2}  # what pd_build_isa returns for each


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def platform_isas() -> tuple[str, ...]:
    """The variants this platform builds, best first: the x86-64 levels, or the compiler's default
    target alone elsewhere."""
    return ISAS if is_x86() else ("baseline",)


def isa_flags(isa: str) -> tuple[str, ...]:
    if isa not in ISAS:
        raise ValueError(f"unknown instruction-set variant {isa!r}; expected one of {', '.join(ISAS)}")
    return X86_FLAGS[isa] if is_x86() else ()


def library_name(isa: str) -> str:
    return f"pd_ops_{isa}.so"


def source_hash() -> str:
    """The hash of the C sources and header: a library built from other sources is stale."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def command(cc: str, isa: str, target: str | Path) -> list[str]:
    return [cc, *COMMON_FLAGS, *isa_flags(isa), f'-DPD_SOURCE_HASH="{source_hash()}"', f"-I{CSRC}",
            *(str(CSRC / s) for s in SOURCES), "-o", str(target), "-lm"]


def compile_variant(cc: str, isa: str, target: Path) -> Path:
    """Compile one variant to `target`: to a private name first, then renamed, so that a process
    never loads a half-written file. Raises subprocess.CalledProcessError (with stderr) on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(command(cc, isa, tmp), check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def cached_build(cc: str, isa: str, cache: Path) -> Path:
    """A variant built on demand into `cache` (a source checkout never installed), reused while
    the sources, flags and compiler stay the same. The cache is made 0700; a library in it is
    loaded only if it is a regular file of this user that nobody else may write, in a directory
    only this user may write (else another local user could plant code this process runs):
    anything else is rebuilt, and a cache directory not of this user's is refused (OSError)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source_hash(), " ".join(command(cc, isa, "")), version, platform.machine()]).encode()).hexdigest()[:16]
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not owned_and_private(cache, directory=True):
        raise PermissionError(f"the kernel cache {cache} is not this user's alone (owner or group/world write): not used")
    target = cache / f"pd_ops_{isa}-{key}.so"
    if os.path.lexists(target) and not owned_and_private(target):
        os.unlink(target)  # planted or loosened: never loaded, built anew
    return target if target.exists() else compile_variant(cc, isa, target)


def owned_and_private(path: Path, directory: bool = False) -> bool:
    """`path` itself (not a link) is a regular file (or a directory) owned by this user, with no
    group or world write bit."""
    st = os.lstat(path)
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
