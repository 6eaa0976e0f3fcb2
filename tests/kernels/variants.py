"""Every instruction-set variant of the C kernels this machine runs (kernels.cpu_native.usable_isas:
baseline everywhere, avx2 and avx512 where the CPU and OS allow), as the pytest fixture `isa`: a
test taking it runs once per variant, with kernels.cpu_native.native() returning that variant for
the test's duration, so that kernels.quant.matmul and a PackedLinear built inside the test call
it too. Nothing here assumes the machine's instruction set: on an AVX2-only runner the avx512
case is simply not generated. Import the fixture by name into a test module to use it.
"""
import pytest

from pdserve.kernels import cpu_native

ISAS = cpu_native.usable_isas()


@pytest.fixture(params=ISAS or [None])
def isa(request, monkeypatch):
    if request.param is None:
        pytest.skip("no C compiler and no installed kernels: no variant to test")
    monkeypatch.setitem(cpu_native._loaded, "", cpu_native.load(request.param))
    return request.param
