"""The 16-row GEMV (kernels/csrc/gemv16_ops.c) against its twin, pd_q_matmul's int16 path on the
weight as the GGUF stores it: the same bits at one and two rows for every natively served type,
through the bound linear (NativeOps.q_linear) and through the one-call decode step's weights.
Runs where the avx512 variant (which builds it) runs; the repacking is checked everywhere."""
import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_native import GEMV16_QTYPES
from pdserve.kernels.quant import QTYPES, QuantTensor, dequantize_raw
from tests.kernels.test_select import random_quant

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the C kernels")


def gemv16_ops():
    ops = cpu_native.load("avx512") if "avx512" in cpu_native.usable_isas() else None
    if ops is None or not ops.has_gemv16:
        pytest.skip("the 16-row GEMV is built in the avx512 variant only, which this machine does not run")
    return ops


@pytest.mark.parametrize("qtype", GEMV16_QTYPES)
def test_the_interleaved_copy_holds_every_scale_and_code_of_the_weight(qtype):
    """Undoing the layout gemv16_ops.c describes gives back the weight's own blocks, value by value."""
    ops = cpu_native.native()
    w = random_quant(qtype, 48, 96, seed=3)
    copy = torch.empty_like(w.raw)
    assert ops.lib.pd_q_repack16(w.raw.data_ptr(), w.raw.stride(0), w.type_id, 48, 96, copy.data_ptr()) == 0
    rb = QTYPES[qtype][1]
    head = 64 if qtype == "Q4_1" else 32
    groups = copy.reshape(3, 96 // 32, 16 * rb)  # (group, block, bytes)
    d = groups[..., :32].contiguous().view(torch.float16).float()  # (group, block, 16 rows)
    codes = groups[..., head:]
    if qtype == "Q8_0":
        q = codes.reshape(3, 3, 16, 16, 2).contiguous().view(torch.int8).float()  # (g, b, pair, row, e)
        q = q.permute(0, 3, 1, 2, 4).reshape(3, 16, 3, 32)
    else:
        c = codes.reshape(3, 3, 4, 2, 16, 2)  # (g, b, chunk, half, row, e)
        lo, hi = (c & 15), (c >> 4)  # pairs 4c+h and 4c+2+h
        pairs = torch.stack([lo[:, :, :, 0], lo[:, :, :, 1], hi[:, :, :, 0], hi[:, :, :, 1]], dim=3)  # (g, b, chunk, 4, row, e)
        q = pairs.reshape(3, 3, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(3, 16, 3, 32).float()
    d = d.permute(0, 2, 1).reshape(48, 3, 1)
    q = q.reshape(48, 3, 32)
    if qtype == "Q4_1":
        m = groups[..., 32:64].contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(48, 3, 1)
        got = d * q + m
    elif qtype == "Q4_0":
        got = d * (q - 8)
    else:
        got = d * q
    assert torch.equal(got.reshape(48, 96), dequantize_raw(w.raw, qtype, 96))


@pytest.mark.parametrize("qtype", GEMV16_QTYPES)
@pytest.mark.parametrize("rows", [1, 2])
def test_the_16_row_gemv_gives_the_int16_paths_bits(qtype, rows):
    ops = gemv16_ops()
    w = random_quant(qtype, 208, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(7)) * 3
    twin = torch.empty(rows, 208)
    assert ops.lib.pd_q_matmul(x.data_ptr(), 160, w.raw.data_ptr(), w.raw.stride(0), w.type_id, rows, 208, 160, twin.data_ptr(), 208,
                               cpu_native.ACTIVATION_MODES["int16"]) == 0
    copy = ops.gemv16_copy(w)
    got = torch.empty(rows, 208)
    assert ops.lib.pd_q_gemv16(x.data_ptr(), 160, copy.data_ptr(), w.type_id, rows, 208, 160, got.data_ptr(), 208) == 0
    assert torch.equal(got, twin)
    assert torch.equal(ops.q_linear(w, "int16")(x), twin)  # the bound linear takes it at these rows


def test_the_bound_linear_keeps_the_int16_gemm_above_two_rows_and_refuses_what_the_gemv_cannot_take():
    ops = gemv16_ops()
    w = random_quant("Q4_1", 64, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    twin = torch.empty(3, 64)
    ops.lib.pd_q_matmul(x.data_ptr(), 96, w.raw.data_ptr(), w.raw.stride(0), w.type_id, 3, 64, 96, twin.data_ptr(), 64, 2)
    assert torch.equal(ops.q_linear(w, "int16")(x), twin)
    assert ops.gemv16_copy(random_quant("Q4_1", 40, 96)) is None  # rows not a multiple of 16: the int16 path as before
    assert ops.lib.pd_q_gemv16(x.data_ptr(), 96, ops.gemv16_copy(w).data_ptr(), w.type_id, 3, 64, 96, twin.data_ptr(), 64) == 3
    assert isinstance(w, QuantTensor) and "_gemv16" in w.__dict__  # made once, kept on the weight
