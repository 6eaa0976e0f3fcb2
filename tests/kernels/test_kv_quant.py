"""The quantized KV cache (kernels/kv_quant.py): the write/read round trip against the float
values, the torch and reference attention over int8 / fp8 pages against the same attention over
the float cache, and the C int8 kernels (rope + quantized write, decode attention) against their
torch twins (kv_quant.pack and kernels.reference over the same int8 pages).

Bounds: int8 stores each (token, head) row to within amax / 254 per element (half a step of
amax / 127); fp8 e4m3 to within 2^-4 of each element's magnitude (3 mantissa bits, nearest), and
amax / 448 * 2^-9 near zero (subnormals). The C write is kv_quant.pack's arithmetic in the same
order and must equal it bit for bit; the C attention over the int8 pages sums in another order
than the reference over the same pages, so it is held to float32 rounding (as
tests/kernels/test_cpu_native.py holds the float kernel).
"""
import pytest
import torch

from pdserve.kernels import cpu_native as cn
from pdserve.kernels import kv_quant, native_build, paged
from pdserve.kernels.reference import paged_attention_ref
from tests.kernels.test_cpu_native import rope_write_case
from tests.kernels.variants import isa  # noqa: F401  (the fixture)

QUANT = (torch.int8, torch.float8_e4m3fn)


def _caches(dtype, blocks=32, bs=16, kvh=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * bs, kvh, d, generator=g) * 3
    v = torch.randn(blocks * bs, kvh, d, generator=g)
    k[5] = 0.0  # an all-zero row: scale 0, codes 0, read back as zeros
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
        if dtype == torch.int8:
            bound = amax / 254 * (1 + 1e-6)
        else:
            bound = x.abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        assert ((back - x).abs() <= bound).all(), f"{dtype}: worst error {(back - x).abs().max():.3e}"
        assert (back[5] == 0).all() if x is k else True
    assert kc.element_size() * kc.shape[-1] == 64 + 4, "a row is D codes + a float32 scale"


def test_write_kv_writes_only_its_slots():
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    kc = torch.zeros(8, 16, 2, 68, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 40, 17, 100])
    paged.write_kv(kc, vc, k, v, slots)
    written = kc.view(-1, 2, 68).abs().sum((1, 2)) > 0
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())
    assert torch.equal(kc.view(-1, 2, 68)[slots], kv_quant.pack(k, torch.int8))


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
        # measured 0.067 (int8) and 0.30 (fp8) at worst over these rows, |v| up to ~4: int8's error is a quarter of fp8's
        assert err < (0.1 if dtype == torch.int8 else 0.45), f"{dtype}: {err:.3e} from the float cache's attention"


def test_triton_refuses_a_quantized_cache():
    _, _, kc, vc = _caches(torch.int8, blocks=2)
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
    rope, qkv, positions, k_cache, v_cache, slots = rope_write_case(heads, kv_heads, head_dim, torch.int8)
    tokens, w = qkv.shape[0], k_cache.shape[-1]
    qkv[3, (heads + kv_heads) * head_dim:(heads + kv_heads + 1) * head_dim] = 0.0  # a zero v row
    before = qkv.clone()
    ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads, kv_heads)
    k0 = before[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v0 = before[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    _, k_ref = rope(positions, before[:, :heads * head_dim].view(tokens, heads, head_dim), k0)
    assert torch.equal(k_cache.view(-1, kv_heads, w)[slots], kv_quant.pack(k_ref, torch.int8))
    assert torch.equal(v_cache.view(-1, kv_heads, w)[slots], kv_quant.pack(v0, torch.int8))
    others = torch.ones(640, dtype=torch.bool)
    others[slots] = False
    assert not k_cache.view(640, -1)[others].any(), "a slot not in slot_mapping was written"


@needs_c
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [(9, 3, 64, 16, 0), (4, 4, 128, 8, 0), (8, 2, 40, 32, 0),
                                                                        (6, 1, 64, 16, 0), (9, 3, 64, 16, 20), (8, 2, 64, 8, 0)])
def test_c_decode_attention_int8_matches_torch_twin(heads, kv_heads, head_dim, block_size, window, ops):
    g = torch.Generator().manual_seed(heads * head_dim + window)
    blocks = 64
    k = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g) * 2
    v = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g)
    shape = (blocks, block_size, kv_heads, head_dim + 4)
    kc, vc = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
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
