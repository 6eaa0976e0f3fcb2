"""Install-time build of the C kernels: every instruction-set variant of kernels/csrc compiled
into kernels/_native/pd_ops_<isa>.so (kernels/native_build.py says how), so that `pip install .`,
`pip install -e .` (scripts/install) and a wheel built once carry them and no request waits for a
compiler. The project's metadata is in pyproject.toml; this file only adds the build step.

Without a C compiler (or where one variant does not compile, e.g. a compiler too old for the
x86-64-v4 level) the install still succeeds with a warning: kernels/cpu_native.py then builds
what it needs on first use, or runs the torch twins.
"""
import importlib.util
import os
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location("native_build", Path(__file__).parent / "kernels" / "native_build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)
PREFIX = "pdserve.kernels._native.pd_ops_"
native_build.INSTALLED.mkdir(exist_ok=True)  # (the package pdserve.kernels._native maps onto it; an sdist may lack it)


class BuildNative(build_ext):
    """build_ext for the kernels' plain shared libraries (loaded with ctypes, not imported)."""

    def get_ext_filename(self, fullname):  # (distutils passes the last name only, setuptools the full one)
        *package, name = fullname.split(".")
        if name.startswith("pd_ops_"):
            return os.path.join(*package, native_build.library_name(name[len("pd_ops_"):]))
        return super().get_ext_filename(fullname)

    def finalize_options(self):
        if self.parallel is None:
            self.parallel = True  # the variants compile side by side (one compiler process each)
        super().finalize_options()

    def copy_extensions_to_source(self):  # (an editable install: kernels/_native of the checkout)
        native_build.INSTALLED.mkdir(exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext):
        if not ext.name.startswith(PREFIX):
            return super().build_extension(ext)
        isa, cc = ext.name[len(PREFIX):], native_build.compiler()
        if cc is None:
            self.announce(f"warning: no C compiler: the {isa} kernels are not built (pdserve runs its torch twins)", level=3)
            return
        try:
            native_build.compile_variant(cc, isa, Path(self.get_ext_fullpath(ext.name)))
        except (OSError, subprocess.SubprocessError) as e:
            self.announce(f"warning: the {isa} kernels did not compile and are left out: {e} {(getattr(e, 'stderr', '') or '')[-2000:]}", level=3)


setup(
    ext_modules=[Extension(PREFIX + isa, sources=[f"kernels/csrc/{s}" for s in native_build.SOURCES],
                           depends=[f"kernels/csrc/{h}" for h in native_build.HEADERS]) for isa in native_build.platform_isas()],
    cmdclass={"build_ext": BuildNative},
)
