"""The fused C kernels (kernels/csrc/cpu_ops.c) against their torch twins and the reference
attention: every shape class the model produces (head dims 64, 128 and an odd one, GQA groups
1-6, block sizes 8/16/32, lengths that end mid-page, rows in any order, strided rows), on every
instruction-set variant the machine runs (the `ops` fixture: tests/kernels/variants.py).

Tolerances: rope and the KV write keep torch's order of operations and must match bit for bit;
the reductions (RMSNorm's sum of squares, attention's dot products and softmax) sum in another
order, so they are held to float32 rounding: 2e-6 relative to the values' scale.
"""
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native as cn
from pdserve.kernels import native_build
from pdserve.kernels.backends import row_bucket
from pdserve.kernels.linear import NATIVE_ROWS, ONEDNN_MAX_ROWS, PackedLinear
from pdserve.kernels.reference import paged_attention_ref
from tests.kernels.variants import ISAS, isa  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(cn.native() is None and native_build.compiler() is None, reason="no C compiler: the fused CPU kernels are not built")


@pytest.fixture
def ops(isa):  # noqa: F811
    """The kernels of one instruction-set variant: each test taking it runs for every variant."""
    return cn.native()


def test_the_kernels_build_where_a_compiler_is():
    """A C source that stops compiling must fail the suite, not fall back to the twins quietly
    (every other test here would still pass, on the slow path)."""
    assert cn.native() is not None, "the C kernels failed to build: see the warning above"
    assert ISAS[-1] == "baseline" and cn.native().isa == ISAS[0], "native() loads the best variant the machine runs"


def close(a, b, rel=2e-6):
    scale = b.abs().max().item() + 1e-30
    err = (a - b).abs().max().item()
    assert err <= rel * scale * 8, f"max error {err:.3e} at scale {scale:.3e}"


# head dim 64: groups of 1-4 heads (the AVX-512 form) at block sizes 16 and 8, and of 6 (the generic one)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 40, 32), (6, 3, 64, 16),
                                                                 (4, 1, 64, 8), (5, 5, 64, 16), (6, 1, 64, 16)])
def test_decode_attention_matches_reference(heads, kv_heads, head_dim, block_size, ops):
    g = torch.Generator().manual_seed(heads * head_dim)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 7 * block_size], dtype=torch.int32)
    batch = lens.numel()
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:8] for _ in range(batch)]).int()
    width = (heads + 2 * kv_heads) * head_dim
    q_rows = torch.randn(batch + 3, width, generator=g)  # wider rows (fused qkv), extra rows unused
    rows = torch.tensor([4, 0, 2, 7, 5])
    out = torch.full((batch + 3, heads * head_dim), float("nan"))
    ops.decode_attention(q_rows, out, rows, k_cache, v_cache, tables, lens, 0.3)
    q = q_rows[rows, : heads * head_dim].view(batch, heads, head_dim)
    ref = paged_attention_ref(
        q, k_cache, v_cache, query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=lens,
        block_tables=tables, max_query_len=1, scale=0.3,
    )
    close(out[rows].view(batch, heads, head_dim), ref)
    untouched = [r for r in range(batch + 3) if r not in rows.tolist()]
    assert torch.isnan(out[untouched]).all(), "rows not asked for were written"


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 1, 64, 8), (4, 4, 128, 8), (8, 2, 40, 32), (6, 1, 64, 16)])
@pytest.mark.parametrize("window", (1, 5, 16, 40))
def test_decode_attention_with_window_matches_reference(heads, kv_heads, head_dim, block_size, window, ops):
    """A sliding window: each sequence reads only its last `window` keys, from mid-page on."""
    g = torch.Generator().manual_seed(window * head_dim)
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, window, window + 1, 3 * block_size - 1, 7 * block_size + 3], dtype=torch.int32)
    tables = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(5)]).int()
    q = torch.randn(5, heads * head_dim, generator=g)
    out = torch.empty(5, heads * head_dim)
    ops.decode_attention(q, out, torch.arange(5), k_cache, v_cache, tables, lens, 0.3, window=window)
    ref = paged_attention_ref(q.view(5, heads, head_dim), k_cache, v_cache, query_start_loc=torch.arange(6, dtype=torch.int32),
                              seq_lens=lens, block_tables=tables, max_query_len=1, scale=0.3, window=window)
    close(out.view(5, heads, head_dim), ref)


def test_decode_attention_long_context_is_stable(ops):
    """Scores far apart (a large max subtracted) and 2,000 keys: no overflow, same as reference."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(128, 16, 1, 64, generator=g) * 4
    v_cache = torch.randn(128, 16, 1, 64, generator=g)
    lens = torch.tensor([2000], dtype=torch.int32)
    tables = torch.randperm(128, generator=g)[:125].int()[None]
    q = torch.randn(1, 2, 64, generator=g) * 4
    out = torch.empty(1, 128)
    ops.decode_attention(q.view(1, 128), out, torch.tensor([0]), k_cache, v_cache, tables, lens, 0.125)
    ref = paged_attention_ref(q, k_cache, v_cache, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=lens,
                              block_tables=tables, max_query_len=1, scale=0.125)
    close(out.view(1, 2, 64), ref, rel=1e-5)


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (130, 576), (3, 100)])
def test_rms_norm_matches_twin(rows, dim, ops):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, dim, generator=g) * 3
    w = torch.randn(dim, generator=g)
    out = torch.empty(rows, dim)
    ops.rms_norm(x, w, out, 1e-5)
    close(out, cn.rms_norm_twin(x, w, 1e-5)[0])
    residual = torch.randn(rows, dim, generator=g)
    expect, expect_res = cn.rms_norm_twin(x, w, 1e-5, residual=residual.clone())
    ops.rms_norm(x, w, out, 1e-5, residual=residual)
    assert torch.equal(residual, expect_res), "the residual add must be exact"
    close(out, expect)


def test_rms_norm_reads_strided_rows(ops):
    base = torch.randn(5, 200)
    x = base[:, 10:74]
    w = torch.randn(64)
    out = torch.empty(5, 64)
    ops.rms_norm(x, w, out, 1e-6)
    close(out, cn.rms_norm_twin(x, w, 1e-6)[0])


@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 160), (64, 1536), (2, 13)])
def test_silu_mul_matches_twin(rows, inter, ops):
    gate_up = torch.randn(rows, 2 * inter) * 6  # wide range: saturated and tiny sigmoids
    out = torch.empty(rows, inter)
    ops.silu_mul(gate_up, out)
    close(out, cn.silu_mul_twin(gate_up), rel=4e-6)


def rope_write_case(heads: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype = torch.float32):
    """rope_write_kv's inputs in its tests: the RoPE table, 70 qkv rows (above the kernel's
    threading threshold) at random positions, empty k / v caches of 40 blocks of 16 slots in
    cache_dtype's rows (kernels.kv_quant.row_width), and 70 random slots."""
    from pdserve.kernels import kv_quant
    from pdserve.runtime.config import RopeScaling
    from pdserve.runtime.rope import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 4096, 10000.0, RopeScaling())
    tokens = 70
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    k_cache = torch.zeros(40, 16, kv_heads, kv_quant.row_width(head_dim, cache_dtype), dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(640, generator=g)[:tokens]
    return rope, qkv, positions, k_cache, v_cache, slots


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 40)])
def test_rope_write_kv_is_bit_exact(heads, kv_heads, head_dim, ops):
    rope, qkv, positions, k_cache, v_cache, slots = rope_write_case(heads, kv_heads, head_dim)
    tokens = qkv.shape[0]
    before = qkv.clone()
    ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads, kv_heads)
    q0 = before[:, : heads * head_dim].view(tokens, heads, head_dim)
    k0 = before[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v0 = before[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    q_ref, k_ref = rope(positions, q0, k0)
    assert torch.equal(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), q_ref)
    assert torch.equal(cn.rope_twin(q0, positions, rope.cos, rope.sin), q_ref)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], k_ref)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v0)
    others = torch.ones(640, dtype=torch.bool)
    others[slots] = False
    assert not k_cache.view(640, -1)[others].any(), "a slot not in slot_mapping was written"


def test_bad_inputs_are_refused_before_c_runs(ops):
    with pytest.raises(ValueError, match="float32"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.zeros(8, 2).t(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="disagree"):
        ops.decode_attention(torch.zeros(2, 64), torch.zeros(2, 64), torch.arange(2), torch.zeros(4, 8, 1, 64),
                             torch.zeros(4, 8, 1, 64), torch.zeros(3, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 80, generator=g)
    fast, twin = PackedLinear(w, b, "onednn"), PackedLinear(w, b, "torch")
    assert fast.kind == "onednn" and twin.kind == "torch"
    close(fast(x), twin(x), rel=4e-6)


@pytest.mark.parametrize("rows", [8, 13, 32, 48])
def test_float_tiled_kernel_matches_f_linear(rows, ops):
    """pd_f_matmul (the tiled kernel reading a float32 weight in place), the auto kind's path at
    NATIVE_ROWS, against its twin F.linear: 53 weight rows (tile and 6-row block tails), K = 80
    (not a multiple of the K chunk), x rows strided wider than K, and into a given out buffer."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(53, 80, generator=g)
    run = ops.f_linear(w)
    if ops.isa == "baseline":  # built from AVX2 up; without it PackedLinear runs oneDNN
        assert run is None and PackedLinear(w, None, "auto").f_run is None
        return
    x = torch.randn(rows, 120, generator=g)[:, :80]
    close(run(x), F.linear(x, w), rel=4e-6)
    out = torch.full((rows, 53), float("nan"))
    assert run(x, out) is out and torch.isfinite(out).all()
    close(out, F.linear(x, w), rel=4e-6)
    auto = PackedLinear(w, None, "auto")
    assert auto.f_run is not None and NATIVE_ROWS[0] <= rows <= NATIVE_ROWS[1]
    close(auto(x.contiguous()), F.linear(x, w), rel=4e-6)


def test_auto_linear_pads_decode_batches_to_few_row_counts_and_matches_f_linear():
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(72, 48, generator=g), torch.randn(72, generator=g)
    auto, twin = PackedLinear(w, b, "auto"), PackedLinear(w, b, "torch")
    assert auto.kind == "auto" and auto.packed is not None
    for rows in [1, 2, 3, 5, 8, 9, 31, 33, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300]:
        x = torch.randn(rows, 48, generator=g)
        y = auto(x)
        assert y.shape == (rows, 72) and y.is_contiguous()
        close(y, twin(x), rel=4e-6)
    assert [row_bucket(r) for r in (1, 2, 3, 5, 8, 9, 16, 17, 127, 128)] == [1, 2, 4, 8, 8, 16, 16, 24, 128, 128]
    assert len({row_bucket(r) for r in range(1, ONEDNN_MAX_ROWS + 1)}) == 19  # primitives oneDNN builds per weight


def test_the_kernel_cache_loads_only_this_users_private_libraries(tmp_path):
    """A library another user could have written (group/world-writable, a link, or in a cache
    directory others may write) is never loaded: it is rebuilt, or the cache is refused."""
    import os

    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    built = native_build.cached_build(cc, "baseline", cache)
    assert oct(cache.stat().st_mode & 0o777) == "0o700" and native_build.owned_and_private(built)
    built.write_bytes(b"planted")  # what another writer could leave, made writable by all
    built.chmod(0o666)
    again = native_build.cached_build(cc, "baseline", cache)
    assert again == built and again.read_bytes()[:4] == b"\x7fELF" and native_build.owned_and_private(again)
    os.unlink(built)
    os.symlink(tmp_path / "elsewhere.so", built)  # a link is not the file itself
    assert native_build.owned_and_private(native_build.cached_build(cc, "baseline", cache))
    cache.chmod(0o777)
    with pytest.raises(PermissionError, match="not this user's alone"):
        native_build.cached_build(cc, "baseline", cache)
