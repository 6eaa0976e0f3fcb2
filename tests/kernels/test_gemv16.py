"""The 16-row GEMV (kernels/csrc/gemv16_ops.c) against its twin, pd_q_matmul's int16 path on the
weight as the GGUF stores it: the same bits for every natively served type at one and two rows, and
at any row count up to PD_GEMV16_ROWS against the twin run one row at a time (the GEMV's passes of
up to 8 rows, the last one short, included), through the bound linear (NativeOps.q_linear) and
through the one-call decode step's weights.
Runs where the avx512 variant (which builds it) runs; the repacking is checked everywhere."""
import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_native import GEMV16_QTYPES
from pdserve.kernels.quant import K256_ROWS, K_QTYPES, QTYPES, QuantTensor, dequantize_raw, matmul_int_twin, takes_k256
from tests.helpers import quant_blocks
from tests.kernels.test_kquant import largest_blocks
from tests.kernels.test_select import random_quant

BLOCK_TYPES = tuple(q for q in GEMV16_QTYPES if q not in K_QTYPES)  # the 32-weight blocks, kept as the GGUF has them

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the C kernels")


def gemv16_ops():
    ops = cpu_native.load("avx512") if "avx512" in cpu_native.usable_isas() else None
    if ops is None or not ops.has_gemv16:
        pytest.skip("the 16-row GEMV is built in the avx512 variant only, which this machine does not run")
    return ops


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
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


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
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


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [3, 8, 9, 16, 17, 40])
def test_more_rows_give_the_bits_of_one_row_at_a_time(qtype, rows):
    """Each activation row's lane arithmetic does not depend on how many rows a pass takes: rows in passes of up to 8
    give, row by row, what the int16 path gives that row alone."""
    ops = gemv16_ops()
    w = random_quant(qtype, 48, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)) * 3
    twin = torch.empty(rows, 48)
    for r in range(rows):
        assert ops.lib.pd_q_matmul(x[r:].data_ptr(), 160, w.raw.data_ptr(), w.raw.stride(0), w.type_id, 1, 48, 160,
                                   twin[r:].data_ptr(), 48, cpu_native.ACTIVATION_MODES["int16"]) == 0
    got = torch.empty(rows, 48)
    assert ops.lib.pd_q_gemv16(x.data_ptr(), 160, ops.gemv16_copy(w).data_ptr(), w.type_id, rows, 48, 160, got.data_ptr(), 48) == 0
    assert torch.equal(got, twin)
    assert torch.equal(ops.q_linear(w, "int16")(x), twin)  # the bound linear takes it at these rows


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_a_k_quant_copy_holds_every_weight_exactly(qtype):
    """The K-quants' copy (Q4_K: the file's fp16 d / dmin and 6-bit scales, nibbles; Q5_K / Q6_K: float32 scales, a
    byte a code) read back as gemv16_ops.c lays it out gives gguf's values bit for bit."""
    ops = gemv16_ops()
    w = quant_blocks(qtype, 32, 512, seed=5)
    copy = ops.gemv16_copy(w)
    assert copy.shape == ops.gemv16_shape(w)
    if qtype == "Q4_K":  # (group, super-block): 16 fp16 d, 16 fp16 dmin, then 8 blocks of 16 sc, 16 mn, 256 nibble bytes
        sup = copy.reshape(2, 2, 64 + 8 * 288)
        d = sup[..., :32].contiguous().view(torch.float16).float()  # (g, sb, 16 rows)
        dmin = sup[..., 32:64].contiguous().view(torch.float16).float()
        blocks = sup[..., 64:].reshape(2, 2, 8, 288)
        sc, mn = blocks[..., :16].float(), blocks[..., 16:32].float()  # (g, sb, j, 16 rows)
        dd = (d.unsqueeze(2) * sc).reshape(2, 16, 16).permute(0, 2, 1).reshape(32, 16, 1)  # exact float32 products
        m = -(dmin.unsqueeze(2) * mn).reshape(2, 16, 16).permute(0, 2, 1).reshape(32, 16, 1)
        c = blocks[..., 32:].reshape(2, 16, 4, 2, 16, 2)  # (g, b, chunk, half, row, e)
        pairs = torch.stack([c[:, :, :, 0] & 15, c[:, :, :, 1] & 15, c[:, :, :, 0] >> 4, c[:, :, :, 1] >> 4], dim=3)
        q = pairs.reshape(2, 16, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(32, 16, 32).float()
        got = dd * q + m
    else:  # (group, block): 16 float32 d, 16 float32 m (Q6_K: the second half's d), then a byte a code
        groups = copy.reshape(2, 16, 16 * cpu_native.GEMV16_ROW_BLOCK_BYTES[qtype])
        scales = groups[..., :128].contiguous().view(torch.float32)
        d, m = scales[..., :16].permute(0, 2, 1).reshape(32, 16, 1), scales[..., 16:].permute(0, 2, 1).reshape(32, 16, 1)
        q = groups[..., 128:].reshape(2, 16, 16, 16, 2).contiguous().view(torch.int8).permute(0, 3, 1, 2, 4).reshape(32, 16, 32).float()
        got = torch.cat([d * q[..., :16], m * q[..., 16:]], -1) if qtype == "Q6_K" else d * q + m
    assert torch.equal(got.reshape(32, 512), w.dequantize())


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_k_quants_take_the_gemv_at_every_row_count_and_equal_the_twin(qtype):
    """The bound linear runs the GEMV on the K-quants at every row count up to GEMV16_ROWS (activations per 32, as
    pd_q_matmul's GEMM rounds them above K256_ROWS; takes_k256 says so to the twin): within float32 rounding of
    matmul_int_twin, also at the largest codes and scales. pd_q_matmul alone keeps its per-256 kernel at few rows."""
    ops = gemv16_ops()
    w = quant_blocks(qtype, 48, 512, seed=6)
    copy = ops.gemv16_copy(w)
    for rows in (1, 2, K256_ROWS, K256_ROWS + 1, 8, 9, 16, 17):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        got = torch.empty(rows, 48)
        assert ops.lib.pd_q_gemv16(x.data_ptr(), 512, copy.data_ptr(), w.type_id, rows, 48, 512, got.data_ptr(), 48) == 0
        assert torch.equal(ops.q_linear(w, "int16")(x), got), rows
        assert not takes_k256(w, rows, "int16") and takes_k256(w, rows, "int8") == (rows <= K256_ROWS)
        terms = x.double().abs() @ w.dequantize().double().abs().t()
        assert ((got.double() - matmul_int_twin(x, w, "int16")).abs() <= 1e-5 * terms).all(), rows
    w = largest_blocks(qtype, 16, 2)
    for sign in (1.0, -1.0):  # every code, scale and activation code at its limit: the int32 lane sums at their bound
        x = torch.full((8, 512), sign)
        got = ops.q_linear(w, "int16")(x).double()
        ref = matmul_int_twin(x, w, "int16")
        assert ((got - ref).abs() <= 1e-5 * (x.double().abs() @ w.dequantize().double().abs().t())).all() and float(ref.abs().min()) > 0


def test_the_bound_linear_keeps_the_int16_gemm_above_the_gemv_rows_and_refuses_what_the_gemv_cannot_take():
    ops = gemv16_ops()
    w = random_quant("Q4_1", 64, 96)
    rows = cpu_native.GEMV16_ROWS + 1
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2))
    twin = torch.empty(rows, 64)
    ops.lib.pd_q_matmul(x.data_ptr(), 96, w.raw.data_ptr(), w.raw.stride(0), w.type_id, rows, 64, 96, twin.data_ptr(), 64, 2)
    assert torch.equal(ops.q_linear(w, "int16")(x), twin)
    assert ops.gemv16_copy(random_quant("Q4_1", 40, 96)) is None  # rows not a multiple of 16: the int16 path as before
    assert ops.lib.pd_q_gemv16(x.data_ptr(), 96, ops.gemv16_copy(w).data_ptr(), w.type_id, rows, 64, 96, twin.data_ptr(), 64) == 3
    assert isinstance(w, QuantTensor) and "_gemv16" in w.__dict__  # made once, kept on the weight


