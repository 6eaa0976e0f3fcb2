"""The fused CPU forward (runtime.cpu_forward) against the module forward it replaces.

Every step of a run that mixes prefill chunks, decodes, preemption-free batching and lone
sequences is computed twice: by the fast path on the live KV cache and by the module forward
(the slow twin) on a copy of it. Logits and the written KV must agree to float32 rounding
(relative 1e-4 of the logits' scale after a few layers of differently ordered sums), and the
greedy choice must be the same unless the twin's top-two logits are within LOGIT_GAP_TOL (a
near-tie). Then the whole greedy output must equal the slow engine's under the same rule.
"""
import pytest

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve_client.params import SamplingParams
from tests.helpers import LOGIT_GAP_TOL, save_tiny_model

pytestmark = pytest.mark.skipif(
    __import__("pdserve.kernels.cpu_native", fromlist=["native"]).native() is None, reason="no C compiler: no fast path"
)

MODELS = {
    "llama-d16": dict(arch="llama"),
    "qwen2-bias": dict(arch="qwen2"),
    "llama-d64-gqa3-tied": dict(arch="llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True),
    "llama-onednn": dict(arch="llama", linear_kind="onednn"),
    # sliding windows shorter than most prompts: on every layer, and on layers 1-2 only
    "mistral-window8": dict(arch="mistral", sliding_window=8),
    "qwen2-window8-layers12": dict(arch="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3-head32": dict(arch="qwen3", head_dim=32),  # per-head q/k norms between the qkv GEMM and RoPE
    # Gemma 2: soft-capped attention (decode rows too: torch's eager path, not the C kernel), four
    # norms a layer, GeGLU, scaled embeddings, final soft-cap, window 8 on layers 0 and 2
    "gemma2-softcap-window8": dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
                                   final_logit_softcapping=4.0, tie_word_embeddings=True),
    # Gemma 3: q/k norms, the sliding layers' own RoPE table, linear scaling on the full layer's
    "gemma3-localrope-window8": dict(arch="gemma3", head_dim=32, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    # mixture of experts: the router and the chosen experts (runtime.moe) in place of the MLP calls
    "moe-mixtral-window8": dict(arch="mixtral", sliding_window=8),
    "moe-qwen3-norm-dense1": dict(arch="qwen3_moe", head_dim=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "moe-qwen2-shared": dict(arch="qwen2_moe"),
}


class TwinCheck:
    """Wraps model.fast: runs the twin on a copy of the cache and compares, step by step."""

    def __init__(self, model):
        self.model, self.fast = model, model.fast
        self.steps = self.mixed_steps = self.near_ties = 0

    def __call__(self, batch, kv_cache):
        kv_ref = kv_cache.clone()
        ref = self.model.forward_modules(batch, kv_ref)
        out = self.fast(batch, kv_cache)
        scale = ref.abs().max().item()
        assert (out - ref).abs().max().item() <= 1e-4 * scale, "fast-path logits differ beyond float32 rounding"
        assert (kv_cache - kv_ref).abs().max().item() <= 1e-4 * max(1.0, kv_ref.abs().max().item())
        top2 = ref.topk(2, dim=-1).values
        for row in range(ref.shape[0]):
            if out[row].argmax() != ref[row].argmax():
                assert top2[row, 0] - top2[row, 1] <= LOGIT_GAP_TOL, "greedy choice flipped without a near-tie"
                self.near_ties += 1
        lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
        self.steps += 1
        self.mixed_steps += int(1 in lens and max(lens) > 1)
        return out


def engine(path, fast: bool, **kw):
    conf = dict(num_blocks=96, block_size=8, max_num_batched_tokens=24, fast_path=fast)
    conf.update(kw)
    return LLMEngine.load(str(path), EngineConfig(**conf), progress=False, tokenizer=False)


def prompts():
    return [[3 + (i * 11 + j * 7) % 500 for j in range(n)] for i, n in enumerate([5, 40, 1, 23, 17, 9, 2])]


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_forward_matches_module_forward_step_by_step(tmp_path, name):
    overrides = dict(MODELS[name])
    kind = overrides.pop("linear_kind", "auto")
    save_tiny_model(tmp_path, max_position_embeddings=256, **overrides)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = engine(tmp_path, True, linear_kind=kind)
    assert fast.model.fast.lm_head.kind == kind
    assert fast.model.fast is not None, "the fast path should be on for float32 on the CPU"
    check = TwinCheck(fast.model)
    fast.model.fast = check
    got = [c.token_ids for c in fast.generate(prompts(), params)]
    assert check.steps > 20 and check.mixed_steps > 0, "the run should mix prefill chunks with decodes"
    slow = engine(tmp_path, False)
    assert slow.model.fast is None
    want = [c.token_ids for c in slow.generate(prompts(), params)]
    if check.near_ties == 0:
        assert got == want
    assert fast.blocks.free_blocks == fast.blocks.num_blocks


def test_fast_path_stays_off_where_it_cannot_run(tmp_path):
    save_tiny_model(tmp_path)
    assert engine(tmp_path, True, dtype="bfloat16").model.fast is None
    assert engine(tmp_path, True, attention_backend="reference").model.fast is None
    on = engine(tmp_path, True, linear_kind="torch")
    assert on.model.fast is not None and on.model.fast.lm_head.kind == "torch"
