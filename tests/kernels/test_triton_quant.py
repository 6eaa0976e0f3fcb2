"""The Triton weight-only matmul over GGUF blocks (kernels/triton_quant.py), CUDA's quantized
linear layer: under TRITON_INTERPRET=1 on the CPU (tests/conftest.py) it equals the float twin
(dequantize, F.linear) to float32 summation order for Q4_0 / Q4_1 / Q8_0, with and without a
bias, at decode and prefill row counts; the `gpu` test runs it compiled for CUDA inside a whole
model, greedy output equal to the same file loaded dequantized."""
import os
from pathlib import Path

import pytest
import torch

from pdserve.kernels.quant import TRITON_QTYPES, matmul_twin
from tests.helpers import run_native_cuda_check
from tests.runtime.test_quantized import random_quant


@pytest.mark.parametrize("qtype", TRITON_QTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_triton_quant_matmul_equals_the_float_twin(qtype, rows):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU run of the Triton kernel needs TRITON_INTERPRET=1")
    from pdserve.kernels import triton_quant

    w = random_quant(qtype, 70, 96, seed=rows)  # 70: a partial tile of weight rows
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(70)
    for b in (None, bias):
        got, ref = triton_quant.matmul(x, w, b), matmul_twin(x, w, b)
        assert got.shape == ref.shape and float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_quant.matmul(torch.randn(rows, 192)[:, ::2], w)
    with pytest.raises(ValueError, match="Q4_K is not a type this kernel takes"):  # dequantized at load on CUDA instead
        triton_quant.matmul(x, random_quant("Q4_K", 70, 256))


def native_cuda_check():
    """A tiny Llama as Q4_1 and Q8_0 GGUF on CUDA: quantized (the Triton kernel) against the same
    file dequantized, float32 and bfloat16 activations, greedy tokens equal."""
    import tempfile

    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine
    from pdserve_client.params import SamplingParams
    from tests.helpers import save_tiny_model, write_gguf

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        save_tiny_model(d / "hf", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        for qtype in ("Q4_1", "Q8_0"):
            write_gguf(d / f"{qtype}.gguf", d / "hf", qtype)
            for dtype in ("float32", "bfloat16"):
                engines = [LLMEngine.load(d / f"{qtype}.gguf", EngineConfig(device="cuda", dtype=dtype, num_blocks=64, quantization=q),
                                          progress=False, tokenizer=False) for q in ("auto", "none")]
                assert engines[0].model.quantized and not engines[1].model.quantized
                assert all(q.raw.is_cuda for q in engines[0].model.quantized.values())
                params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
                prompts = [[5, 9, 12, 30, 7], list(range(3, 40))]
                outs = [[c.token_ids for c in e.generate(prompts, params)] for e in engines]
                assert outs[0] == outs[1], (qtype, dtype, outs)


@pytest.mark.gpu
def test_triton_quant_native_cuda_serves_like_the_dequantized_model():
    run_native_cuda_check(__file__)
