"""The fused mixture-of-experts Triton kernels (kernels/triton_moe.py), CUDA's MoE layer: under
TRITON_INTERPRET=1 on the CPU (tests/conftest.py) they equal the dense twin (runtime.moe.experts_dense)
to float32 summation order, for decode and prefill token counts and several top-k; an expert no
token chose is never read; the `gpu` test runs them compiled for CUDA inside a whole Mixtral and
a Qwen2-MoE, greedy output equal to the dense twin's."""
import os

import pytest
import torch

from pdserve.runtime import moe
from tests.helpers import run_native_cuda_check


def _interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of the Triton kernel needs TRITON_INTERPRET=1")
    from pdserve.kernels import triton_moe

    return triton_moe


def _layer(tokens: int, top_k: int, seed: int, e: int = 6, h: int = 48, i: int = 40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=g)
    router, gate_up, down = torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 4, torch.randn(e, h, i, generator=g) / 4
    weights, ids = moe.route(x @ router.T, top_k, True, float_weights=False)
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 1), (37, 2), (20, 6)])
def test_fused_moe_equals_the_dense_twin(tokens, top_k):
    triton_moe = _interpreted()
    x, weights, ids, gate_up, down = _layer(tokens, top_k, tokens * 10 + top_k)
    got, ref = triton_moe.fused_moe(x, weights, ids, gate_up, down), moe.experts_dense(x, weights, ids, gate_up, down)
    assert got.shape == ref.shape == x.shape
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_align_puts_each_tile_on_one_expert_and_every_assignment_once():
    triton_moe = _interpreted()
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    padded, tiles = triton_moe.align(ids, 6, 4)
    n = ids.numel()
    real = padded[padded < n]
    assert sorted(real.tolist()) == list(range(n))  # every (token, slot) once
    assert padded.numel() == 4 * tiles.numel()
    for t, e in enumerate(tiles.tolist()):  # a tile holds its expert's assignments only (and pads)
        assert all(ids.reshape(-1)[a].item() == e for a in padded[4 * t:4 * t + 4].tolist() if a < n)
    assert sorted(set(tiles.tolist())) == [0, 1, 3, 5]  # experts 2 and 4, chosen by nobody, have no tile


def test_an_expert_nobody_chose_is_never_read():
    triton_moe = _interpreted()
    x, weights, ids, gate_up, down = _layer(9, 2, 7)
    unchosen = sorted(set(range(gate_up.shape[0])) - set(ids.flatten().tolist()))
    if not unchosen:  # make one: route every token to experts 0 and 1
        ids = torch.tensor([[0, 1]] * x.shape[0])
        unchosen = list(range(2, gate_up.shape[0]))
    gate_up[unchosen], down[unchosen] = float("nan"), float("nan")
    assert torch.isfinite(triton_moe.fused_moe(x, weights, ids, gate_up, down)).all()
    assert not torch.isfinite(moe.experts_dense(x, weights, ids, gate_up, down)).all()  # the twin reads them all


def test_fused_moe_refuses_stacks_that_do_not_fit():
    triton_moe = _interpreted()
    x, weights, ids, gate_up, down = _layer(3, 2, 1)
    with pytest.raises(ValueError, match="do not fit"):
        triton_moe.fused_moe(x, weights, ids, gate_up, down[:, :, :-1])


def native_cuda_check():
    """Tiny Mixtral and Qwen2-MoE on CUDA: the fused kernels (MoEBlock's CUDA branch) against the
    dense twin, float32 and bfloat16, greedy tokens equal, and the kernels really ran."""
    import tempfile
    from pathlib import Path

    from pdserve.kernels import triton_moe
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams
    from tests.helpers import save_tiny_model

    calls = []
    real = triton_moe.fused_moe

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    triton_moe.fused_moe = counted
    with tempfile.TemporaryDirectory() as d:
        for arch in ("mixtral", "qwen2_moe"):
            save_tiny_model(Path(d) / arch, arch=arch)
            for dtype in ("float32", "bfloat16"):
                eng = LLMEngine.load(Path(d) / arch, EngineConfig(device="cuda", dtype=dtype, num_blocks=64), progress=False, tokenizer=False)
                params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
                prompts = [[5, 9, 12, 30, 7], list(range(3, 40))]
                before = len(calls)
                fused = [c.token_ids for c in eng.generate(prompts, params)]
                assert len(calls) > before, "the fused kernels did not run"
                for layer in eng.model.layers:
                    if hasattr(layer.mlp, "dense"):
                        layer.mlp.dense = True
                dense = [c.token_ids for c in eng.generate(prompts, params)]
                assert fused == dense, (arch, dtype, fused, dense)


@pytest.mark.gpu
def test_triton_fused_moe_native_cuda_serves_like_the_dense_twin():
    run_native_cuda_check(__file__)
