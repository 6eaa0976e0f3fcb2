"""How the C kernels pick their instruction set (kernels/native_build.py, kernels/cpu_native.py,
kernels/csrc/isa_probe.c) and how the install step builds them (setup.py).

- pd_cpu_features agrees with the flags Linux lists in /proc/cpuinfo (Linux leaves out a flag
  whose register state the kernel does not enable, as the probe does with XCR0);
- every variant the machine runs reports the level it was compiled for and the sources' hash;
- PDSERVE_ISA forces a variant in a fresh process; an unknown name is refused;
- `setup.py build_ext` puts every variant at kernels/_native/pd_ops_<isa>.so, cpu_native loads an
  installed library built from the current sources and builds instead where they changed.
None of it assumes this machine's instruction set.
"""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_native as cn
from pdserve.kernels import native_build
from tests.kernels.variants import ISAS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler and no installed kernels")
NEEDS = {"avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"},
         "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}, "avx512_bf16": {"avx512_bf16"}}


@pytest.mark.skipif(not (native_build.is_x86() and Path("/proc/cpuinfo").exists()), reason="x86 Linux only")
def test_probe_agrees_with_proc_cpuinfo():
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split(":")[1].split())
    features = cn.cpu_features()
    for name, needs in NEEDS.items():
        below = {"avx512": "avx2", "avx512_bf16": "avx512"}.get(name)
        expected = needs <= flags and (below is None or below in features)
        assert (name in features) == expected, (name, sorted(needs - flags))
    assert ISAS == [isa for isa in native_build.ISAS if cn.ISA_NEEDS[isa] == 0 or isa in features]


def test_each_variant_reports_its_level_and_sources():
    for isa in ISAS:
        lib = cn.load(isa).lib
        assert lib.pd_build_isa() == native_build.ISA_LEVEL[isa]
        assert lib.pd_source_hash().decode() == native_build.source_hash()


def test_pdserve_isa_forces_a_variant_and_refuses_unknown_names(monkeypatch):
    probe = "from pdserve.kernels import cpu_native; print(cpu_native.native().isa)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_ISA": ISAS[-1]}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == ISAS[-1] == "baseline"
    monkeypatch.setenv("PDSERVE_ISA", "sse9")
    with pytest.raises(ValueError, match="unknown instruction-set variant 'sse9'"):
        cn._choose()


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")
def test_install_step_builds_every_variant_and_stale_ones_are_rebuilt(tmp_path, monkeypatch):
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    built = tmp_path / "lib" / "pdserve" / "kernels" / "_native"
    assert sorted(p.name for p in built.iterdir()) == sorted(native_build.library_name(i) for i in native_build.platform_isas())
    for isa in ISAS:  # the ones this machine can run: each is what its name says, from these sources
        lib = ctypes.CDLL(str(built / native_build.library_name(isa)))
        lib.pd_source_hash.restype = ctypes.c_char_p
        assert lib.pd_build_isa() == native_build.ISA_LEVEL[isa] and lib.pd_source_hash().decode() == native_build.source_hash()
    monkeypatch.setattr(native_build, "INSTALLED", built)
    assert cn._library_path("baseline") == built / "pd_ops_baseline.so"  # installed, current: loaded as it is
    monkeypatch.setattr(native_build, "source_hash", lambda: "0000000000000000")  # the sources changed since
    monkeypatch.setattr(cn, "cache_dir", lambda: tmp_path / "cache")
    rebuilt = cn._library_path("baseline")
    assert rebuilt.parent == tmp_path / "cache" and rebuilt.exists()
    shutil.rmtree(tmp_path / "lib")
