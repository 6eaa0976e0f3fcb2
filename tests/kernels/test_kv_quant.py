"""The quantized KV cache (kernels/kv_quant.py): the write/read round trip against the float
values, the Hadamard rotation, the torch and reference attention over int8 / fp8 pages against
the same attention over the float cache, and the C int8 kernels (rope + quantized write, decode
attention, generic and AVX-512 forms) against their torch twins (kv_quant.pack, and
kernels.reference over the same pages: kv_quant.unpack + float attention).

Bounds: int8 stores each (token, head) row's rotation y = H x to within about half a step s / 2
per element (s = its float16 scale, about (max y - min y) / 255; the float16 rounding of s can
leave the top of the range up to s / 8 short), and x = H y / D then to within the same per
element (a mean of the y errors); fp8 e4m3 to within 2^-4 of each element's magnitude (3 mantissa
bits, nearest), and amax / 448 * 2^-9 near zero (subnormals). The C write is kv_quant.pack's
arithmetic in the same order (the butterflies, float16 rounding included) and must equal it bit
for bit; the C attention over the int8 pages rotates the query and the output instead of the rows
and sums in another order than the reference over the same pages, so it is held to float32
rounding (as tests/kernels/test_cpu_native.py holds the float kernel).
"""
import pytest
import torch

from pdserve.kernels import cpu_native as cn
from pdserve.kernels import kv_quant, native_build, paged
from pdserve.kernels.reference import paged_attention_ref
from tests.kernels.test_cpu_native import rope_write_case
from tests.kernels.variants import isa  # noqa: F401  (the fixture)

QUANT = (kv_quant.INT8, kv_quant.FP8)
INT8 = kv_quant.INT8


def _caches(dtype, blocks=32, bs=16, kvh=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * bs, kvh, d, generator=g) * 3
    v = torch.randn(blocks * bs, kvh, d, generator=g)
    k[5] = 0.0  # an all-zero row: scale 0, codes 0, read back as zeros
    k[6] = 2.5  # a constant row, and (its rotation constant) a one-hot one
    k[7] = 0.0
    k[7, :, 3] = -4.0
    v[8, :, 11] = 300.0  # a large outlier
    shape = (blocks, bs, kvh, kv_quant.row_width(d, dtype))
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    paged.write_kv(kc, vc, k, v, torch.arange(blocks * bs))
    return k, v, kc, vc


@pytest.mark.parametrize("dtype", QUANT)
def test_write_read_round_trip_within_bound(dtype):
    k, v, kc, vc = _caches(dtype)
    for x, c in ((k, kc), (v, vc)):
        back = kv_quant.unpack(c.view(-1, *c.shape[2:]))
        amax = x.abs().amax(-1, keepdim=True)
        if dtype == INT8:
            bound = kv_quant.scales(c.view(-1, *c.shape[2:])) * 0.63 + amax * 1e-6
        else:
            bound = x.abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        assert ((back - x).abs() <= bound).all(), f"{dtype}: worst error {(back - x).abs().max():.3e}"
        assert (back[5] == 0).all() if x is k else True
    assert kc.element_size() * kc.shape[-1] == 64 + 4, "a row is D codes + 4 bytes: a float32 scale, or a float16 scale and int16 zero"
    if dtype == INT8:  # a constant row rotates to one nonzero channel (H 1 = D e0) and comes back exact; a one-hot
        # row rotates to two values +-a, which the integer zero code may put half a step off (each by s / 2)
        back = kv_quant.unpack(kc.view(-1, *kc.shape[2:]))
        torch.testing.assert_close(back[6], k[6], rtol=2.0 ** -11, atol=1e-6)  # (the float16 scale's rounding)
        assert ((back[7] - k[7]).abs() <= kv_quant.scales(kc.view(-1, *kc.shape[2:])[7]) / 2 * (1 + 1e-5)).all()
        rms = lambda e: e.pow(2).mean().sqrt().item()  # noqa: E731
        # the rotation's gain on gaussian rows with one outlier each: the error of symmetric per-row int8 (amax / 127
        # steps, what int8 stored before) is about the outlier's; rotated asymmetric codes spread it over the row
        g = torch.Generator().manual_seed(9)
        x = torch.randn(256, 64, generator=g)
        x[torch.arange(256), torch.randint(0, 64, (256,), generator=g)] = 20.0
        sym = torch.round(x / (x.abs().amax(-1, keepdim=True) / 127)) * (x.abs().amax(-1, keepdim=True) / 127)
        assert rms(kv_quant.unpack(kv_quant.pack(x, INT8)) - x) < 0.5 * rms(sym - x)


@pytest.mark.parametrize("d", (8, 64, 128))
def test_hadamard_is_the_sylvester_matrix_and_its_own_inverse_over_d(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # H_2n = [[H, H], [H, -H]]
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(kv_quant.hadamard(x), x @ h, rtol=0, atol=1e-4)  # (float32 sums of d terms, in two orders)
    torch.testing.assert_close(kv_quant.hadamard(kv_quant.hadamard(x)) / d, x, rtol=0, atol=1e-5)
    assert torch.equal(h @ h, d * torch.eye(d)) and kv_quant.rotated(d) and not kv_quant.rotated(40)


def test_int8_rows_layout_and_edge_rows():
    """The metadata bytes (float16 scale, int16 zero code), and rows at float16's edges: a scale under its
    range (tiny values), one clamped to 65504 (a huge range), a row far from zero (the zero code's int16 limit)."""
    x = torch.zeros(6, 40)  # D = 40: not rotated, the codes are the row's own
    x[0] = torch.linspace(-1.0, 3.0, 40)
    x[1] = torch.linspace(-1e-9, 1e-9, 40)
    x[2] = torch.linspace(-1e8, 1e8, 40)
    x[3] = 1000.0 + torch.linspace(0, 0.01, 40)
    x[4] = -7.0  # constant
    rows = kv_quant.pack(x, INT8)
    s, z = kv_quant.scales(rows), kv_quant.zero_codes(rows)
    assert rows.dtype == torch.uint8 and rows.shape == (6, 44)
    assert s[0].item() == torch.tensor(4.0 / 255).half().item() and z[0].item() == round(1.0 / s[0].item())
    assert rows[0, 0] == 0 and rows[0, 39] == 255 and s[5].item() == 0 and z[5].item() == 0 and not rows[5].any()
    assert s[1].item() == 2.0 ** -24 and s[2].item() == 65504.0
    back = kv_quant.unpack(rows)
    assert (back[0] - x[0]).abs().max() <= s[0] * 0.63
    assert (back[3] - x[3]).abs().max() <= 1000.0 / 32000 and abs(z[3].item()) <= 32767
    assert (back[4] - x[4]).abs().max() <= 7.0 * 2.0 ** -11
    assert (back[1] - x[1]).abs().max() <= 2e-9 and torch.isfinite(back).all()


def test_write_kv_writes_only_its_slots():
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    kc = torch.zeros(8, 16, 2, 68, dtype=INT8)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 40, 17, 100])
    paged.write_kv(kc, vc, k, v, slots)
    written = kc.view(-1, 2, 68).int().sum((1, 2)) > 0
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())
    assert torch.equal(kc.view(-1, 2, 68)[slots], kv_quant.pack(k, INT8))


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("backend", ("torch", "reference"))
def test_attention_over_quantized_pages_is_attention_over_their_values(dtype, backend):
    """Prefill and decode over a quantized cache equal the same attention over the float cache
    holding the dequantized values (the reading is exact; only the write rounds), and stay near
    the attention over the original float KV."""
    k, v, kc, vc = _caches(dtype, seed=3)
    kf, vf = kv_quant.unpack(kc), kv_quant.unpack(vc)  # the values the quantized cache holds
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([1, 40, 130], dtype=torch.int32)
    tables = torch.stack([torch.randperm(32, generator=g)[:9] for _ in range(3)]).int()
    for q_lens in ((1, 1, 1), (1, 7, 130)):
        q = torch.randn(sum(q_lens), 9, 64, generator=g)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        kw = dict(query_start_loc=starts, seq_lens=lens, block_tables=tables, max_query_len=max(q_lens), scale=0.125, backend=backend)
        got = paged.paged_attention(q, kc, vc, **kw)
        same = paged.paged_attention(q, kf, vf, **kw)
        torch.testing.assert_close(got, same, rtol=1e-5, atol=1e-5)
        orig = paged.paged_attention(q, k.view(kc.shape[:3] + (64,)), v.view(kc.shape[:3] + (64,)), **kw)
        err = (got - orig).abs().max().item()
        # measured 0.047 (int8; 0.067 symmetric unrotated) and 0.30 (fp8) at worst over these rows, |v| up to ~4 (one 300)
        assert err < (0.1 if dtype == INT8 else 0.45), f"{dtype}: {err:.3e} from the float cache's attention"


def test_triton_refuses_a_quantized_cache():
    _, _, kc, vc = _caches(INT8, blocks=2)
    with pytest.raises(kv_quant.KVCacheDtypeError, match="Triton"):
        paged.paged_attention(torch.randn(1, 3, 64), kc, vc, query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([3]),
                              block_tables=torch.tensor([[0, 1]]), max_query_len=1, scale=0.1, backend="triton")


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(kv_quant.KVCacheDtypeError, match="int8"):
        kv_quant.storage_dtype("int4", torch.float32)


# ------------------------------------------------------------------ the C int8 kernels

needs_c = pytest.mark.skipif(cn.native() is None and native_build.compiler() is None, reason="no C compiler")


@pytest.fixture
def ops(isa):  # noqa: F811
    return cn.native()


@needs_c
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 40)])
def test_c_rope_write_kv_int8_is_pack_bit_for_bit(heads, kv_heads, head_dim, ops):
    """The C write (RoPE, the rotation where D is a power of two, the asymmetric codes) against kv_quant.pack, with
    v rows at the format's edges: zero, constant, one-hot (a constant rotation), a large outlier, values under
    float16's range (the scale's floor), a huge range (its ceiling), a row far from zero (the zero code's limit)."""
    rope, qkv, positions, k_cache, v_cache, slots = rope_write_case(heads, kv_heads, head_dim, INT8)
    tokens, w = qkv.shape[0], k_cache.shape[-1]
    v_at = (heads + kv_heads) * head_dim
    edges = {3: torch.zeros(head_dim), 4: torch.full((head_dim,), -2.5), 5: torch.zeros(head_dim).index_fill_(0, torch.tensor([1]), 3.0),
             6: torch.randn(head_dim).index_fill_(0, torch.tensor([7]), 500.0), 7: torch.randn(head_dim) * 1e-9,
             8: torch.randn(head_dim) * 1e8, 9: 1e4 + torch.randn(head_dim) * 1e-3}
    for t, row in edges.items():
        qkv[t, v_at:v_at + head_dim] = row
    qkv[10, heads * head_dim + 2] = 400.0  # a k outlier (before RoPE)
    before = qkv.clone()
    ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads, kv_heads)
    k0 = before[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v0 = before[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    _, k_ref = rope(positions, before[:, :heads * head_dim].view(tokens, heads, head_dim), k0)
    assert torch.equal(k_cache.view(-1, kv_heads, w)[slots], kv_quant.pack(k_ref, INT8))
    assert torch.equal(v_cache.view(-1, kv_heads, w)[slots], kv_quant.pack(v0, INT8))
    others = torch.ones(640, dtype=torch.bool)
    others[slots] = False
    assert not k_cache.view(640, -1)[others].any(), "a slot not in slot_mapping was written"
    rows = v_cache.view(-1, kv_heads, w)[slots[3:10], 0]
    err = (kv_quant.unpack(rows) - v0[3:10, 0]).abs().amax(-1)  # within s / 2 (+ float16's share) of each edge row
    bound = kv_quant.scales(rows)[:, 0] * 0.63 + v0[3:10, 0].abs().amax(-1) * 1e-6
    assert (err <= bound)[[0, 1, 2, 3, 4, 6]].all() and torch.isfinite(err).all()  # (row 8's range is past float16's: clipped)


@needs_c
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [(9, 3, 64, 16, 0), (4, 4, 128, 8, 0), (8, 2, 40, 32, 0),
                                                                        (6, 1, 64, 16, 0), (9, 3, 64, 16, 20), (8, 2, 64, 8, 0)])
def test_c_decode_attention_int8_matches_torch_twin(heads, kv_heads, head_dim, block_size, window, ops):
    g = torch.Generator().manual_seed(heads * head_dim + window)
    blocks = 64
    k = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g) * 2
    v = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g)
    k[::7, :, 5] = 40.0  # rows with a large outlier, constant rows, one-hot rows (a constant rotation)
    v[3::11, :, 9] = -30.0
    k[1::13], v[2::13] = 1.5, -0.75
    v[4::17] = 0.0
    v[4::17, :, 2] = 6.0
    shape = (blocks, block_size, kv_heads, head_dim + 4)
    kc, vc = torch.zeros(shape, dtype=INT8), torch.zeros(shape, dtype=INT8)
    paged.write_kv(kc, vc, k, v, torch.arange(blocks * block_size))
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 7 * block_size], dtype=torch.int32)
    batch = lens.numel()
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(batch)]).int()
    q_rows = torch.randn(batch + 3, (heads + 2 * kv_heads) * head_dim, generator=g)
    rows = torch.tensor([4, 0, 2, 7, 5])
    out = torch.full((batch + 3, heads * head_dim), float("nan"))
    ops.decode_attention(q_rows, out, rows, kc, vc, tables, lens, 0.3, window=window)
    q = q_rows[rows, :heads * head_dim].view(batch, heads, head_dim)
    kw = dict(query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=lens, block_tables=tables, max_query_len=1, scale=0.3,
              window=window)
    ref = paged_attention_ref(q, kc, vc, **kw)  # the reference over the same int8 pages
    got = out[rows].view(batch, heads, head_dim)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 2e-6 * 8 * scale
    torch.testing.assert_close(paged.paged_attention(q, kc, vc, backend="torch", **kw), ref, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(batch + 3) if r not in rows.tolist()]
    assert torch.isnan(out[untouched]).all(), "rows not asked for were written"
