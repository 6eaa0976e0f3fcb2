"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 served from their blocks (kernels/quant.py,
kernels/csrc/quant_ops.c).

- The torch twin (`dequantize`) equals the gguf package's numpy dequantizer bit for bit on random
  blocks (every code, scale, min and high-bit pattern: random bytes under sane fp16 scales), and
  so does the C dequantizer (the embedding lookup and the prefill path's weights), on every
  instruction-set variant the machine runs.
- The integer form the C kernels take (`int_form`: codes, a scale per 16 weights, an offset per
  32) rebuilds the twin's weights.
- Every matmul path (float activations: direct up to 4 rows, tiled to 128, dequantize + MKL
  above; int16: direct up to 7 rows, the integer GEMM above; int8: direct up to 4 rows) equals
  its twin to float32 summation order, the bound the Q4_0 tests state
  (tests/runtime/test_quantized.py): max error <= 1e-5 of the output's largest magnitude; the
  float paths against `matmul_twin` (dequantize, F.linear), the integer ones against
  `matmul_int_twin` (float64), and int16 within 1e-4 of the float twin.
- The K-quants' few-row form (up to K256_ROWS rows: activations rounded per 256-wide super-block,
  int16 or int8 = llama.cpp's q8_K, sub-block scales applied in integers, quant_ops.c
  qk16_rows_* / qk8_rows_avx2 / qk256_row_scalar) equals `matmul_int_twin`'s integer math to
  float32 rounding (1e-5 of the sum of the products' magnitudes), also at the largest codes and
  scales each type holds (the int32 lane sums' bound) and with an outlier in x; against the float
  twin it stays within the rounding's own bound, half a step of each super-block's activations
  times its weights' magnitudes (`rounding_bound`; measured at ~5e-5 of the output's largest
  magnitude for int16 on normal x, 1.3e-4 with an outlier; int8 ~1e-2).
- The test quantizer (tests/helpers.py quantize_blocks, for the K-quants gguf cannot quantize)
  writes blocks gguf's dequantizer reads back within half a quantization step.
"""
import gguf
import numpy as np
import pytest
import torch

from pdserve.kernels import backends, cpu_native
from pdserve.kernels.quant import (
    DIRECT_INT_ROWS,
    INT_LIMITS,
    K256_ROWS,
    K_QTYPES,
    QTYPES,
    QuantTensor,
    block_weights,
    int_form,
    matmul,
    matmul_int_twin,
    matmul_twin,
    takes_k256,
)
from tests.helpers import quant_blocks, quantize_blocks
from tests.kernels.variants import isa  # noqa: F401  (the fixture: a test taking it runs on every instruction-set variant)

pytestmark = pytest.mark.skipif(cpu_native.native() is None, reason="needs a C compiler for the quantized kernels")

NEW = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


def gguf_dequantized(w: QuantTensor) -> torch.Tensor:
    arr = gguf.quants.dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[w.qtype]).reshape(w.shape)
    return torch.from_numpy(arr.astype(np.float32))


def width(qtype: str, blocks: int) -> int:
    return blocks * block_weights(qtype)


@pytest.mark.parametrize("qtype", NEW)
def test_twin_and_c_dequantizer_equal_gguf_bit_for_bit(qtype, isa):  # noqa: F811
    w = quant_blocks(qtype, 37, width(qtype, 3), seed=1)
    ref = gguf_dequantized(w)
    assert torch.isfinite(ref).all() and float(ref.abs().max()) > 0
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(cpu_native.native().q_dequant(w), ref)
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(w.rows_float(rows), ref[rows]) and torch.equal(w.rows(rows), ref[rows])
    if qtype in K_QTYPES:  # every sub-block's scale and min takes part: its 6 bits, both halves of the packed bytes
        codes, scale, offset = int_form(w)
        assert len(torch.unique(scale)) > 8 * 3 and (qtype == "Q6_K" or len(torch.unique(offset)) > 8 * 3)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_int_form_rebuilds_the_twin(qtype):
    w = quant_blocks(qtype, 9, width(qtype, 2), seed=2)
    codes, scale, offset = int_form(w)
    n, k = w.shape
    rebuilt = (scale.repeat_interleave(16, -1) * codes.double() + offset.repeat_interleave(32, -1))
    assert torch.allclose(rebuilt, w.dequantize().double(), rtol=0, atol=1e-6 * float(w.dequantize().abs().max()))
    lo, hi = {"Q6_K": (-32, 31), "Q8_0": (-128, 127), "Q5_0": (0, 31), "Q5_1": (0, 31), "Q5_K": (0, 31)}.get(qtype, (0, 15))
    assert int(codes.min()) >= lo and int(codes.max()) <= hi


@pytest.mark.parametrize("qtype", NEW)
@pytest.mark.parametrize("shape", [(53, 2), (16, 1), (130, 3)])  # (weight rows, blocks of K): ragged panels / groups of 8 / tiles
def test_every_matmul_path_equals_its_twin(qtype, shape, isa):  # noqa: F811
    n, blocks = shape
    k = width(qtype, blocks) if qtype in K_QTYPES else width(qtype, 8 * blocks + 1)
    w = quant_blocks(qtype, n, k, seed=n)
    g = torch.Generator().manual_seed(n)
    for rows in (1, 2, 3, 4, 5, 7, 8, 16, 33, 64, 131):
        x = torch.randn(rows, k + 64, generator=g)[:, :k]  # rows strided wider than K
        x[0, :32] = 0.0  # a zero block (int scale 0)
        bias = torch.randn(n, generator=g)
        ref = matmul_twin(x, w, bias)
        got = matmul(x, w, bias)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), (rows, "float")
        for kind in ("int8", "int16"):
            got_int = matmul(x, w, activations=kind)
            if rows > DIRECT_INT_ROWS[kind]:  # int8 takes small decode batches; larger ones stay float (int16: every size)
                assert torch.equal(got_int, matmul(x, w)), (rows, kind)
                continue
            ref_int = matmul_int_twin(x, w, kind)
            assert float((got_int.double() - ref_int).abs().max()) <= 1e-5 * float(ref_int.abs().max()), (rows, kind)
            assert not torch.equal(got_int, matmul(x, w))  # the integer path does round the activations
            plain = matmul_twin(x, w)
            err = float((got_int - plain).abs().max()) / float(plain.abs().max())
            assert err <= (1e-4 if kind == "int16" else 3e-2), (rows, kind, err)


def terms(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """Each output's sum of its products' magnitudes, |x| @ |W|^T: what float32 rounding scales with."""
    return x.double().abs() @ w.dequantize().double().abs().t()


def rounding_bound(x: torch.Tensor, w: QuantTensor, kind: str) -> torch.Tensor:
    """|x @ W^T - (rounded x) @ W^T| <= sum over super-blocks of half a code step (max|x| / 2L there)
    times the super-block's sum of |W|: the per-256 rounding's largest cost, output by output."""
    rows, nsb = x.shape[0], x.shape[1] // 256
    half_step = x.double().abs().reshape(rows, nsb, 256).amax(-1) / (2 * INT_LIMITS[kind])
    return half_step @ w.dequantize().double().abs().reshape(-1, nsb, 256).sum(-1).t()


def largest_blocks(qtype: str, rows: int, blocks: int) -> QuantTensor:
    """Super-blocks at the extremes the per-256 kernels' int32 lane sums are bounded by: every code
    and scale the largest in magnitude (Q4_K / Q5_K: codes 15 / 31 under scale 63; Q6_K: q = 0, code
    -32, under scale -128), fp16 d = 1 (dmin = 1: mins 63)."""
    nbytes = QTYPES[qtype][1]
    blk = np.zeros(nbytes, np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == "Q6_K":
        blk[192:208] = 0x80  # int8 scales -128; ql, qh zero: q = 0
        blk[208:210] = one
    else:
        blk[0:2] = blk[2:4] = one
        blk[4:16] = 0xFF  # every 6-bit scale and min 63
        blk[16:] = 0xFF  # codes 15 (Q5_K: and every fifth bit: 31)
    raw = np.tile(blk, (rows, blocks))
    return QuantTensor(torch.from_numpy(raw), qtype, (rows, blocks * 256))


@pytest.mark.parametrize("qtype", K_QTYPES)
@pytest.mark.parametrize("kind", ["int16", "int8"])
def test_k_quants_few_row_form_equals_its_integer_twin(qtype, kind, isa):  # noqa: F811
    g = torch.Generator().manual_seed(7)
    for n, blocks in ((53, 2), (16, 1), (9, 8)):
        w = quant_blocks(qtype, n, 256 * blocks, seed=n)
        for rows in range(1, K256_ROWS + 1):
            x = torch.randn(rows, 256 * blocks + 64, generator=g)[:, :256 * blocks]  # rows strided wider than K
            x[0, :256] = 0.0  # a zero super-block (scale 0)
            if rows > 1:
                x[1, 3] = 40.0  # an outlier: its super-block's other codes coarser
            # per 256, but with int16 on a weight the 16-row GEMV takes (AVX-512 VNNI, rows a multiple of 16): per 32
            per_32 = kind == "int16" and cpu_native.native().gemv16_copy(w) is not None
            assert takes_k256(w, rows, kind) != per_32 and not takes_k256(w, rows, "float") and not takes_k256(w, K256_ROWS + 1, kind)
            got = matmul(x, w, activations=kind).double()
            ref = matmul_int_twin(x, w, kind)
            assert ((got - ref).abs() <= 1e-5 * terms(x, w)).all(), (n, blocks, rows)
            slack = rounding_bound(x, w, kind) + 1e-5 * terms(x, w)
            assert ((got - matmul_twin(x, w).double()).abs() <= slack).all(), (n, blocks, rows)
    w = largest_blocks(qtype, 24, 8)
    for sign in (1.0, -1.0):  # every activation code at its limit: the lane sums at their bound
        x = torch.full((K256_ROWS, w.shape[1]), sign)
        got, ref = matmul(x, w, activations=kind).double(), matmul_int_twin(x, w, kind)
        assert ((got - ref).abs() <= 1e-5 * terms(x, w)).all() and float(ref.abs().min()) > 0


@pytest.mark.parametrize("qtype", NEW)
def test_types_the_special_kernels_do_not_take_are_declined_not_miscomputed(qtype, isa):  # noqa: F811
    """The 16-row GEMV (gemv16_ops.c) repacks Q4_0 / Q4_1 / Q8_0 and the K-quants (these only above K256_ROWS rows),
    not Q5_0 / Q5_1, and the int8 VNNI GEMM (pd_q_gemm_i8) does not take the K-quants: each declines (None), the bound
    linear then runs pd_q_matmul (at 2 rows: the K-quants' per-256 kernel), and the back-end selector never offers
    them."""
    ops = cpu_native.native()
    w = quant_blocks(qtype, 32, width(qtype, 1 if qtype in K_QTYPES else 8), seed=4)
    assert (ops.gemv16_copy(w) is None) == (qtype not in cpu_native.GEMV16_QTYPES or not ops.has_gemv16)
    if qtype in K_QTYPES:
        assert ops.q_linear_i8_gemm(w) is None and backends.BY_NAME["c-int8-vnni"].bind(w) is None
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(5))
    ref = matmul_int_twin(x, w, "int16")
    got = ops.q_linear(w, "int16")(x)
    # float32 sums of 256 products: their rounding scales with the products' magnitudes, not with the
    # result's (a row that nearly cancels was 2.8e-5 of max|ref| once, with an unseeded x)
    terms = float((x.abs() @ w.dequantize().abs().t()).max())
    assert float((got.double() - ref).abs().max()) <= 1e-5 * terms


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_the_test_quantizer_writes_blocks_gguf_reads_back(qtype):
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32) * 0.05
    x[0, :256] = np.abs(x[0, :256])  # a super-block with no negative weights (min 0)
    raw = quantize_blocks(x, qtype)
    assert raw.shape == (6, 2 * QTYPES[qtype][1])
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(6, 512)
    sub = 16 if qtype == "Q6_K" else 32
    groups = x.reshape(6, -1, sub)
    if qtype == "Q6_K":  # symmetric: codes q - 32 in -31..31 of max|x| / 31
        step = np.abs(groups).max(-1) / 31
    else:  # codes 0..15 / 0..31 from the sub-block's min (or 0) up
        step = (groups.max(-1) - np.minimum(groups.min(-1), 0)) / {"Q4_K": 15, "Q5_K": 31}[qtype]
    err = np.abs(back - x).reshape(6, -1, sub).max(-1)
    assert (err <= 0.5 * step * 1.3 + 1e-6).all(), float((err / step).max())  # half a step, and the 6-bit scales' own rounding
    w = QuantTensor(torch.from_numpy(raw), qtype, (6, 512))
    assert torch.equal(w.dequantize(), torch.from_numpy(back.astype(np.float32)))
