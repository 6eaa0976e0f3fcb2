"""--kv-cache-dtype in the engine (kernels.kv_quant): the pool's dtype and capacity, greedy
generation with an int8 / fp8 cache against the float cache, and the CPU fast path (C int8
kernels; fp8 through torch) against the module forward (torch paged attention, the slow twin)
over the same quantized cache."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.errors import NotSupportedError
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.weights import load_checkpoint
from pdserve_client.errors import InvalidRequestError
from pdserve_client.params import SamplingParams
from tests.helpers import tiny_engine

PROMPTS = [list(range(3, 23)), [5, 9, 12, 30, 7], list(range(40, 101, 2))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_the_pool_holds_4d_over_d_plus_4_times_the_blocks_in_int8(tiny):
    cfg, _ = load_checkpoint(str(tiny), progress=False)
    d = cfg.head_dim
    blocks = {kv: EngineConfig(kv_cache_bytes=64 * 2**20, kv_cache_dtype=kv).blocks_for_budget(cfg) for kv in ("auto", "int8", "fp8")}
    rows = 2 * cfg.num_layers * 16 * cfg.num_kv_heads  # (token, head) rows of a block of 16, K and V
    assert blocks["auto"] == 64 * 2**20 // (rows * 4 * d)
    assert blocks["int8"] == blocks["fp8"] == 64 * 2**20 // (rows * (d + 4))  # D codes + 4 bytes a row (a scale and zero code)
    assert abs(blocks["int8"] / blocks["auto"] - 4 * d / (d + 4)) < 0.01  # 3.76x at the default model's D = 64; 2.67x at this one's 8
    _, pool = tiny_engine(tiny, kv_cache_dtype="int8")
    assert pool.dtype == torch.uint8 and pool.shape[-1] == d + 4 and pool.nbytes == 64 * rows // 16 * 8 * (d + 4)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(NotSupportedError, match="Triton"):
        EngineConfig(kv_cache_dtype="int8", device="cuda")
    assert EngineConfig(kv_cache_dtype="fp8").kv_torch_dtype == torch.float8_e4m3fn == EngineConfig(kv_cache_dtype="fp8_e4m3").kv_torch_dtype


# int8: at least 90% of the tokens where the float cache's are (measured 30 of 30); fp8 (3 mantissa
# bits) drifts sooner on this random model's flat logits (measured 21 of 30): its first tokens only
@pytest.mark.parametrize("kv,share", (("int8", 0.9), ("fp8", 0.0)))
def test_quantized_cache_generates_the_float_caches_greedy_tokens(tiny, kv, share):
    ref, _ = tiny_engine(tiny)
    got, pool = tiny_engine(tiny, kv_cache_dtype=kv)
    assert pool.dtype == EngineConfig(kv_cache_dtype=kv).kv_torch_dtype
    want = [c.token_ids for c in ref.generate(PROMPTS, GREEDY)]
    have = [c.token_ids for c in got.generate(PROMPTS, GREEDY)]
    same = sum(a == b for w, h in zip(want, have) for a, b in zip(w, h))
    assert [h[0] for h in have] == [w[0] for w in want], "first tokens"
    assert same >= share * sum(map(len, want)), f"{kv}: {same} of {sum(map(len, want))} tokens as the float cache's"


@pytest.mark.parametrize("kv", ("int8", "fp8"))
def test_fast_path_over_a_quantized_cache_equals_its_torch_twin(tiny, kv):
    """The CPU fast path (C RoPE + quantized write and C int8 decode attention; fp8: torch's) and
    the module forward (paged.write_kv + kernels.torch_paged) over the same kind of cache."""
    fast, _ = tiny_engine(tiny, kv_cache_dtype=kv)
    slow, _ = tiny_engine(tiny, kv_cache_dtype=kv, fast_path=False)
    assert fast.model.fast is not None and slow.model.fast is None
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    for a, b in zip(fast.generate(PROMPTS, params), slow.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
        # the forms' K differs at float32 rounding, which may move a value across a code boundary:
        # one int8 step is amax / 127, one fp8 step 1/8 of the value (measured 4e-3 in fp8)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < (1e-3 if kv == "int8" else 1e-2)
