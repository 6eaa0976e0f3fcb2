"""Paged attention and KV writes: every fast path against the slow reference.

Lifecycle: pytest collects this module; each case builds a small random paged cache whose
pages are handed out in shuffled order (plus spare pages of unrelated data and a padded block
table) so that any paging bug changes the result, then compares a backend with
kernels.reference. Triton runs under TRITON_INTERPRET=1 here (tests/conftest.py); the `gpu`
test runs it natively in a subprocess, since the interpreter choice is fixed at triton import.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import paged, torch_paged
from tests.helpers import run_native_cuda_check

TOL = 1e-3
BLOCK_SIZES = (8, 16, 32)
# (query heads, kv heads): GQA ratios 1, 3 and 8.
HEAD_LAYOUTS = ((4, 4), (3, 1), (9, 3), (8, 1), (16, 2))
HEAD_DIMS = (64, 128)
SCENARIOS = ("decode", "prefill", "chunked", "mixed")


def scenario(name: str, bs: int) -> tuple[list[int], list[int]]:
    """(query lengths, context lengths incl. the new tokens): ragged, with 1 and block-boundary lengths."""
    if name == "decode":
        return [1] * 6, [1, bs, 2 * bs, 37, 2 * bs + 1, bs - 1]
    if name == "prefill":
        return [bs, 2 * bs + 3, 1, 19], [bs, 2 * bs + 3, 1, 19]
    if name == "chunked":
        return [7, bs, 1, 2 * bs], [2 * bs + 5, 3 * bs, 20, 2 * bs + 1]
    if name == "mixed":
        return [1, 9, 1, bs, 2], [33, 9, bs, 3 * bs, 2 * bs]
    raise ValueError(name)


def make_case(q_lens, seq_lens, *, block_size, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Random q and paged caches with shuffled page ids; returns (q, k_cache, v_cache, attention kwargs)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages_per_seq) + 5  # spare pages hold data no sequence owns
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(pages_per_seq) + 2), int(perm[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_per_seq):
        tables[i, :n] = perm[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = dict(
        query_start_loc=query_start_loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(q_lens), scale=head_dim**-0.5,
    )
    return q, k_cache, v_cache, kwargs


def assert_matches_reference(backend, name, block_size, heads, kv_heads, head_dim, dtype=torch.float32, tol=TOL, window=0):
    q_lens, seq_lens = scenario(name, block_size)
    q, k_cache, v_cache, kw = make_case(
        q_lens, seq_lens, block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
    )
    kw["window"] = window
    ref = paged.paged_attention(q, k_cache, v_cache, backend="reference", **kw)
    out = paged.paged_attention(q, k_cache, v_cache, backend=backend, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    diff = (out.float() - ref.float()).abs().max().item()
    assert diff <= tol, f"{backend} {name}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_torch_matches_reference(name, block_size, heads, kv_heads, head_dim):
    assert_matches_reference("torch", name, block_size, heads, kv_heads, head_dim)


# Under the interpreter every head layout is not needed with every head dim: ratios 1 and 8 at
# D=64, ratio 3 at both, ratio 8 with two kv heads at D=128.
TRITON_HEADS = (
    (3, 1, 64), (9, 3, 64), (8, 1, 64), (4, 4, 128), (9, 3, 128), (16, 2, 128),
)


def triton_cases():
    """Each scenario with each block size, with two head layouts each (one of head_dim 64, one of
    128), rotated so that every scenario meets every layout: 24 cases under the interpreter (a
    full cross is 72, ~50 s; scripts/gpu_check compiles the kernels for real)."""
    for s, name in enumerate(SCENARIOS):
        for b, block_size in enumerate(BLOCK_SIZES):
            for heads in (TRITON_HEADS[(s + b) % 3], TRITON_HEADS[3 + (s + 2 * b) % 3]):
                yield name, block_size, *heads


@pytest.mark.parametrize("name,block_size,heads,kv_heads,head_dim", list(triton_cases()))
def test_triton_matches_reference(name, block_size, heads, kv_heads, head_dim):
    assert_matches_reference("triton", name, block_size, heads, kv_heads, head_dim)


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("name", ("decode", "chunked"))
def test_bfloat16_close_to_reference(backend, name):
    assert_matches_reference(backend, name, 16, 9, 3, 64, dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("head_dim", (16, 80, 256))
def test_other_head_dims(backend, head_dim):
    """Beyond 64 and 128: a small and a large power of two, and 80, which triton pads to 128."""
    for name in ("decode", "mixed"):
        assert_matches_reference(backend, name, 16, 4, 2, head_dim)


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("window", (1, 7, 16))
@pytest.mark.parametrize("name", SCENARIOS)
def test_sliding_window_matches_reference(backend, name, window):
    """A sliding window narrower than some contexts, wider than others, and of one key."""
    assert_matches_reference(backend, name, 8, 9, 3, 64, window=window)
    if backend == "torch":
        assert_matches_reference(backend, name, 16, 4, 4, 128, window=window)


def test_reference_window_is_transformers_rule():
    """The reference's window is transformers' sliding-window causal mask (masking_utils): a chunk of
    7 queries over a 40-token context, window 16, against sdpa over the mask transformers builds."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, k_cache, v_cache, kw = make_case([7], [40], block_size=8, heads=4, kv_heads=2, head_dim=64)
    out = paged.paged_attention(q, k_cache, v_cache, backend="reference", window=16, **kw)
    allowed_by = sliding_window_causal_mask_function(16)
    mask = allowed_by(torch.tensor(0), torch.tensor(0), torch.arange(33, 40)[:, None], torch.arange(40)[None, :])  # (7, 40)
    k, v = _contiguous_context(k_cache, v_cache, kw["block_tables"][0], 40)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask, scale=kw["scale"])
    assert (out - dense[0].transpose(0, 1)).abs().max() < 1e-5
    assert not mask[0, :18].any() and mask[0, 18:34].all()  # position 33 sees 18..33


def test_negative_window_raises():
    q, k_cache, v_cache, kw = make_case([1], [4], block_size=8, heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="window"):
        paged.paged_attention(q, k_cache, v_cache, window=-1, **kw)


@pytest.mark.parametrize("gather_bytes", (1, 40_000))
def test_torch_decode_in_chunks(monkeypatch, gather_bytes):
    """A tiny gather budget forces the decode batch through one or a few sequences per chunk."""
    monkeypatch.setattr(torch_paged, "_GATHER_BYTES", gather_bytes)
    assert_matches_reference("torch", "decode", 16, 9, 3, 64)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("length", (45, 600))
def test_torch_prefill_is_bit_identical_to_hf_sdpa(length, dtype):
    """No cached prefix: the same sdpa call as transformers' Llama (repeat_kv, is_causal=True)."""
    q, k_cache, v_cache, kw = make_case([length], [length], block_size=16, heads=9, kv_heads=3, head_dim=64, dtype=dtype)
    out = paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw)
    k, v = _contiguous_context(k_cache, v_cache, kw["block_tables"][0], length)
    hf = F.scaled_dot_product_attention(
        q.unsqueeze(0).transpose(1, 2), _repeat_kv(k, 3), _repeat_kv(v, 3), is_causal=True, scale=kw["scale"],
    )[0].transpose(0, 1)
    assert torch.equal(out, hf)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("length", (53, 700))
def test_torch_single_decode_is_bit_identical_to_hf_sdpa(length, dtype):
    """One sequence decoding: no mask, no padding, exactly transformers' sdpa decode call."""
    q, k_cache, v_cache, kw = make_case([1], [length], block_size=16, heads=9, kv_heads=3, head_dim=64, dtype=dtype)
    out = paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw)
    k, v = _contiguous_context(k_cache, v_cache, kw["block_tables"][0], length)
    hf = F.scaled_dot_product_attention(q.view(1, 9, 1, 64), _repeat_kv(k, 3), _repeat_kv(v, 3), scale=kw["scale"])
    assert torch.equal(out, hf.view(1, 9, 64))


def _contiguous_context(k_cache, v_cache, table, seq_len):
    """(1, KVH, S, D) keys and values of one sequence, as transformers' dense cache holds them."""
    pos = torch.arange(seq_len)
    blocks, offsets = table.long()[pos // k_cache.shape[1]], pos % k_cache.shape[1]
    return k_cache[blocks, offsets].transpose(0, 1)[None], v_cache[blocks, offsets].transpose(0, 1)[None]


def _repeat_kv(x, n_rep):
    b, kvh, s, d = x.shape
    return x[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def test_auto_is_torch_on_cpu():
    q, k_cache, v_cache, kw = make_case([1, 1], [5, 17], block_size=8, heads=4, kv_heads=2, head_dim=64)
    auto = paged.paged_attention(q, k_cache, v_cache, **kw)
    assert torch.equal(auto, paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw))


def test_write_kv_places_values_at_slots():
    block_size, kv_heads, head_dim = 8, 2, 64
    k_cache = torch.zeros(6, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([4, 4, 0, 5, 2])
    offsets = torch.tensor([0, 7, 3, 1, 6])
    k = torch.randn(5, kv_heads, head_dim)
    v = torch.randn(5, kv_heads, head_dim)
    paged.write_kv(k_cache, v_cache, k, v, blocks * block_size + offsets)
    assert torch.equal(k_cache[blocks, offsets], k)
    assert torch.equal(v_cache[blocks, offsets], v)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 5  # nothing else written
    assert int((v_cache != 0).any(-1).any(-1).sum()) == 5


def test_write_then_attend_round_trip():
    """Prefill 20 tokens, decode one more through write_kv: the decode sees all 21 keys."""
    bs, heads, kv_heads, head_dim = 8, 4, 2, 64
    k_cache = torch.zeros(5, bs, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[3, 0, 4, 1]], dtype=torch.int32)
    k, v = torch.randn(21, kv_heads, head_dim), torch.randn(21, kv_heads, head_dim)
    pos = torch.arange(21)
    paged.write_kv(k_cache, v_cache, k, v, table[0].long()[pos // bs] * bs + pos % bs)
    q = torch.randn(1, heads, head_dim)
    kw = dict(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([21], dtype=torch.int32),
        block_tables=table, max_query_len=1, scale=0.125,
    )
    out = paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw)
    dense = F.scaled_dot_product_attention(
        q.view(1, heads, 1, head_dim), _repeat_kv(k.transpose(0, 1)[None], 2), _repeat_kv(v.transpose(0, 1)[None], 2),
        scale=0.125,
    )
    assert (out - dense.view(1, heads, head_dim)).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", paged.BACKENDS)
def test_empty_batch(backend):
    q = torch.empty(0, 4, 64)
    k_cache = torch.zeros(2, 8, 2, 64)
    out = paged.paged_attention(
        q, k_cache, k_cache.clone(), query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.empty(0, dtype=torch.int32), block_tables=torch.empty(0, 1, dtype=torch.int32),
        max_query_len=1, scale=0.125, backend=backend,
    )
    assert out.shape == (0, 4, 64)


def test_unknown_backend_raises():
    q, k_cache, v_cache, kw = make_case([1], [3], block_size=8, heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="backend"):
        paged.paged_attention(q, k_cache, v_cache, backend="flash", **kw)


def test_heads_not_multiple_of_kv_heads_raises():
    q, k_cache, v_cache, kw = make_case([1], [3], block_size=8, heads=5, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="multiple"):
        paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw)


def test_mismatched_batch_raises():
    q, k_cache, v_cache, kw = make_case([1, 1], [3, 4], block_size=8, heads=4, kv_heads=2, head_dim=64)
    kw["block_tables"] = kw["block_tables"][:1]
    with pytest.raises(ValueError, match="block_tables"):
        paged.paged_attention(q, k_cache, v_cache, backend="torch", **kw)


def test_import_is_cheap_and_does_not_shadow_the_pypi_kernels():
    """No triton at import time; and from the repository root `import kernels` is Hugging Face's
    package (transformers >= 5.25 imports it), never our kernels/ folder."""
    code = ("import sys, pathlib, pdserve.kernels.paged; assert 'triton' not in sys.modules\n"
            "import kernels; assert not pathlib.Path(kernels.__file__).is_relative_to(sys.argv[1]), kernels.__file__")
    subprocess.run([sys.executable, "-c", code, str(_REPO / "kernels")], check=True, cwd=_REPO)


_REPO = Path(__file__).resolve().parents[2]


def native_cuda_check() -> None:
    """Triton compiled for CUDA vs the reference, float32 and bfloat16; run with TRITON_INTERPRET=0."""
    for name in SCENARIOS:
        for block_size in BLOCK_SIZES:
            for heads, kv_heads, head_dim in TRITON_HEADS:
                for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, 3e-2)):
                    q_lens, seq_lens = scenario(name, block_size)
                    q, k_cache, v_cache, kw = make_case(
                        q_lens, seq_lens, block_size=block_size, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, dtype=dtype,
                    )
                    ref = paged.paged_attention(q, k_cache, v_cache, backend="reference", **kw)
                    cuda = [t.cuda() for t in (q, k_cache, v_cache)]
                    kw_cuda = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()}
                    out = paged.paged_attention(*cuda, backend="auto", **kw_cuda).cpu()
                    diff = (out.float() - ref.float()).abs().max().item()
                    assert diff <= tol, f"native triton {name} bs={block_size} {heads}/{kv_heads} D={head_dim} {dtype}: {diff:.2e}"


@pytest.mark.gpu
def test_triton_native_cuda_matches_reference():
    run_native_cuda_check(__file__)


@pytest.mark.parametrize("window", (0, 7))
@pytest.mark.parametrize("name", SCENARIOS)
def test_softcap_matches_reference(name, window):
    """Soft-capped scores (Gemma 2: s -> cap * tanh(s / cap)) on the torch backend's every path
    (batched decode, per-sequence prefill and chunks: its eager twin of sdpa) against the
    reference; a cap of 0.5 on scores of about 1 changes the output, so the check binds."""
    q, k_cache, v_cache, kw = make_case(*scenario(name, 8), block_size=8, heads=9, kv_heads=3, head_dim=64)
    ref = paged.paged_attention(q, k_cache, v_cache, backend="reference", window=window, softcap=0.5, **kw)
    out = paged.paged_attention(q, k_cache, v_cache, backend="torch", window=window, softcap=0.5, **kw)
    assert (out - ref).abs().max() <= TOL
    uncapped = paged.paged_attention(q, k_cache, v_cache, backend="reference", window=window, **kw)
    assert (uncapped - ref).abs().max() > 100 * TOL


@pytest.mark.parametrize("window", (0, 5))
def test_softcapped_fresh_prompts_equal_one_by_one(window):
    """attend_fresh (n prompts of one length in one call) soft-capped, against attend_one per prompt, its twin."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 12, 8, 32, generator=g), torch.randn(3, 12, 2, 32, generator=g), torch.randn(3, 12, 2, 32, generator=g)
    together = torch_paged.attend_fresh(q, k, v, 32**-0.5, window, softcap=0.7)
    for i in range(3):
        assert torch.equal(together[i], torch_paged.attend_one(q[i], k[i], v[i], 32**-0.5, window, softcap=0.7))


def test_softcap_is_refused_where_the_kernel_lacks_it():
    """The Triton kernel has no soft-cap: asked for one, kernels.paged refuses it by name (before
    importing Triton), and an engine on CUDA refuses a soft-capped model with a typed error
    before building it."""
    from pdserve.common.errors import NotSupportedError
    from pdserve.runtime.config import EngineConfig, ModelConfig
    from pdserve.runtime.engine import check_attention_backend

    q, k_cache, v_cache, kw = make_case([1], [4], block_size=8, heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(NotImplementedError, match="soft-capping.*Triton"):
        paged.paged_attention(q, k_cache, v_cache, backend="triton", softcap=50.0, **kw)
    with pytest.raises(ValueError, match="softcap"):
        paged.paged_attention(q, k_cache, v_cache, softcap=-1.0, **kw)
    gemma2 = ModelConfig.from_hf(dict(architectures=["Gemma2ForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, head_dim=8))
    with pytest.raises(NotSupportedError, match="soft-capping.*CUDA"):
        check_attention_backend(gemma2, EngineConfig(device="cuda"))
    check_attention_backend(gemma2, EngineConfig())  # the CPU serves it
    check_attention_backend(dataclasses.replace(gemma2, attn_softcap=0.0), EngineConfig(device="cuda"))


def _freed_before_windows(kw, window: int, bs: int, nan_page: int) -> torch.Tensor:
    """The block tables with every page wholly before its sequence's first query's window
    pointed at nan_page: what a sequence of an all-window model holds once those pages are freed
    (runtime.kv_cache.drop_outside_window)."""
    tables = kw["block_tables"].clone()
    starts = kw["query_start_loc"].tolist()
    for i, seq_len in enumerate(kw["seq_lens"].tolist()):
        first_key = max(0, seq_len - (starts[i + 1] - starts[i]) - window + 1)
        tables[i, : first_key // bs] = nan_page
    return tables


@pytest.mark.parametrize("backend", ("torch", "triton", "c"))
@pytest.mark.parametrize("name", ("decode", "chunked", "mixed"))  # a prefill from position 0 frees nothing
def test_pages_before_the_window_are_never_read(backend, name):
    """Pages wholly before a sequence's window (freed, their table entries anything) are not read:
    pointed at a page of NaN, whose any read reaches the output (0 * NaN), every backend gives
    the same bits as with the real pages. The C kernel decodes only."""
    bs, window = 8, 7
    q_lens, seq_lens = scenario(name, bs)
    if backend == "c" and max(q_lens) > 1:
        pytest.skip("the C kernel decodes only")
    q, k_cache, v_cache, kw = make_case(q_lens, seq_lens, block_size=bs, heads=9, kv_heads=3, head_dim=64)
    nan_page = k_cache.shape[0]
    k_nan, v_nan = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (k_cache, v_cache))
    freed = _freed_before_windows(kw, window, bs, nan_page)
    assert (freed == nan_page).any(), "the case frees no page"

    def run(k, v, tables):
        if backend != "c":
            return paged.paged_attention(q, k, v, backend=backend, window=window, **{**kw, "block_tables": tables})
        from pdserve.kernels import cpu_native

        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
        cpu_native.native().decode_attention(q.reshape(q.shape[0], -1), out, torch.arange(q.shape[0]), k, v, tables, kw["seq_lens"],
                                             kw["scale"], window=window)
        return out.view(q.shape)

    whole = run(k_cache, v_cache, kw["block_tables"])
    assert torch.isfinite(whole).all()
    assert torch.equal(run(k_nan, v_nan, freed), whole)
