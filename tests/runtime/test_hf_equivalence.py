"""Greedy output equals HF transformers token for token (see tests/helpers.py for the one
allowed near-tie divergence), on tiny random Llama/Qwen2/Mistral/Qwen3/Phi-3/Gemma 2/Gemma 3
checkpoints (sliding windows included) and on the default model, one sequence at a time and as
one mixed-length batch. Gemma's options each bind in its test configs: every one, removed from
our model, moves its logits far from HF's (`test_gemma_features_bind`); so do YaRN's frequency
correction and attention factor (`test_yarn_features_bind`)."""
import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.runtime.config import EngineConfig, RopeScaling
from pdserve.runtime.engine import LLMEngine, build_model
from pdserve.runtime.weights import load_checkpoint
from pdserve_client.params import SamplingParams
from tests.helpers import all_position_logits, assert_greedy_equal, hf_from_gguf, hf_greedy, save_tiny_model

# Gemma 2: soft-caps small enough for random weights' scores and logits to pass them, window 8 on
# layers 0 and 2 (transformers' default pattern), head_dim 32 while hidden / heads is 16,
# query_pre_attn_scalar 24 (not head_dim), tied embeddings (Gemma's default)
GEMMA2 = dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
              final_logit_softcapping=4.0, tie_word_embeddings=True)
# Gemma 3: q/k norms, sliding layers 0 and 2 on a local rope base of 1000, the full layer on
# 100000 with linear scaling x4 (as Gemma 3 4B+), no attention soft-cap (its default), a final one
GEMMA3 = dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=4.0,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})

QWEN3_YARN = dict(arch="qwen3", head_dim=32, max_position_embeddings=128, rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})

# Mixtral (softmax over the top-2 logits) with a sliding window 16; Qwen3-MoE (q/k norms,
# norm_topk_prob, top 3, layer 1 dense by mlp_only_layers); Qwen2-MoE (shared expert with its
# sigmoid gate, top-k weights not renormalised, q/k/v biases, layer 1 dense by decoder_sparse_step 2)
MOE = {
    "mixtral-window16": dict(arch="mixtral", sliding_window=16),
    "qwen3-norm-top3-dense1": dict(arch="qwen3_moe", head_dim=32, norm_topk_prob=True, num_experts_per_tok=3, mlp_only_layers=[1]),
    "qwen2-shared-sparse2": dict(arch="qwen2_moe", decoder_sparse_step=2, num_hidden_layers=4),
}
ROUTER_GAP_TOL = 1e-3  # the least gap between a token's k-th and (k+1)-th router logit in the MoE tests (float32 rounding: ~1e-6)

CONFIGS = {
    "llama": dict(arch="llama"),
    "llama-tied-mha": dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama3-rope": dict(arch="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(arch="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2-bias": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=1),
    # sliding window 16: prompts of 1-16 tokens fit it, 17-50 do not, and 24 decode steps pass it
    "mistral-window16": dict(arch="mistral", sliding_window=16),
    "qwen2-window16-layers12": dict(arch="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
    # Qwen3: per-head q/k RMSNorm before RoPE, head_dim 32 while hidden / heads is 16
    "qwen3-head32": dict(arch="qwen3", head_dim=32),
    "qwen3-window16-tied": dict(arch="qwen3", head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=16,
                                max_window_layers=0),
    # YaRN as Qwen3's model card sets it (factor 4), over an original context of 32 that prompts
    # and decoding pass (up to 74 tokens); max_position_embeddings 4 x 32, as transformers expects
    "qwen3-yarn": QWEN3_YARN,
    # YaRN's other keys: betas, mscale / mscale_all_dim for the attention factor, no truncation
    "llama-yarn-betas-mscale-untruncated": dict(arch="llama", max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
        "beta_slow": 2.0, "mscale": 2.0, "mscale_all_dim": 0.5, "truncate": False}),
    # dynamic NTK: transformers' base grows only past max_position_embeddings, which is never served
    "llama-dynamic-rope": dict(arch="llama", max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                                           "factor": 2.0}),
    # Phi-3: fused qkv_proj / gate_up_proj (split at load); its sliding_window slides every layer
    "phi3": dict(arch="phi3"),
    "phi3-window16-mha": dict(arch="phi3", sliding_window=16, num_key_value_heads=4),
    "gemma2-softcap-window8-tied": GEMMA2,
    "gemma3-qknorm-localrope-window8": GEMMA3,
    # transformers 5's defaults otherwise: Gemma 3 untied, without any soft-cap, every 6th layer full
    "gemma3-defaults-untied": dict(arch="gemma3", head_dim=16, sliding_window=8, num_hidden_layers=6, query_pre_attn_scalar=16),
    # mixture of experts: 8 experts, top 2, routers scaled far from ties (tests/helpers.py ROUTER_SCALE)
    **{f"moe-{k}": v for k, v in MOE.items()},
}


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 17, 33, 50][:n]
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_random_models_match_hf(tmp_path, name):
    from transformers import AutoModelForCausalLM

    cfg = save_tiny_model(tmp_path, **CONFIGS[name])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    engine = LLMEngine.load(str(tmp_path), EngineConfig(num_blocks=64, block_size=8), progress=False, tokenizer=False)
    prompts = _prompts(6, cfg["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = [hf_greedy(hf, p, 24, eos=False) for p in prompts]
    one_by_one = [engine.generate([p], params)[0].token_ids for p in prompts]
    batched = [c.token_ids for c in engine.generate(prompts, params)]
    compared = 0
    for i, (tokens, logits) in enumerate(refs):
        compared += assert_greedy_equal(one_by_one[i], tokens, logits, f"{name} prompt {i} alone")
        compared += assert_greedy_equal(batched[i], tokens, logits, f"{name} prompt {i} in batch")
    assert compared >= 0.9 * 2 * sum(len(t) for t, _ in refs)  # near-ties are rare, not the rule
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def _without(feature: str, cfg, tensors: dict):
    """(config, tensors) of our model with one Gemma feature taken out: what serving the
    checkpoint without that feature would compute."""
    r = dataclasses.replace
    if feature == "norms 1 + w":  # the norms' stored (1 + w) back to w
        return cfg, {k: v - 1 if k.endswith("norm.weight") else v for k, v in tensors.items()}
    if feature == "sandwich norms":  # the Llama layer: pre_feedforward_layernorm as its post-attention norm, the others unused
        return r(cfg, sandwich_norms=False), {**tensors, **{k.replace("pre_feedforward", "post_attention"): v for k, v in tensors.items()
                                                             if "pre_feedforward" in k}}
    return r(cfg, **{"embedding scale": dict(embed_scale=1.0), "GeGLU": dict(activation="silu"),
                     "query_pre_attn_scalar": dict(query_pre_attn_scalar=0.0), "attention soft-cap": dict(attn_softcap=0.0),
                     "final soft-cap": dict(final_softcap=0.0), "sliding windows": dict(layer_windows=()),
                     "q/k norms": dict(qk_norm=False), "local rope base": dict(rope_local_theta=0.0),
                     "global rope scaling": dict(rope_scaling=RopeScaling())}[feature]), tensors


_COMMON = ["embedding scale", "norms 1 + w", "sandwich norms", "GeGLU", "query_pre_attn_scalar", "final soft-cap"]


def hf_reference_logits(path):
    """HF's model of the checkpoint at path, a 40-token random prompt, HF's float32 logits of it and
    their largest magnitude (the scale a feature's effect is judged against)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    return hf, ids, ref, ref.abs().max().item()


@pytest.mark.parametrize("name,overrides,features", [
    ("gemma2", GEMMA2, [*_COMMON, "attention soft-cap", "sliding windows"]),
    ("gemma3", GEMMA3, [*_COMMON, "q/k norms", "local rope base", "global rope scaling"]),
])
def test_gemma_features_bind(tmp_path, name, overrides, features):
    """Every position's logits of a 40-token prompt (past the window 8), from our model (fast path
    and module forward) and from HF: equal to float32 rounding, and with any one feature taken
    out of ours, off by more than 5% of the logits' scale, so the greedy tests above would see
    a missing feature. (The final soft-cap is monotonic, so greedy tokens alone cannot show it.)"""

    save_tiny_model(tmp_path, **overrides)
    hf, ids, ref, scale = hf_reference_logits(tmp_path)
    cfg, tensors = load_checkpoint(str(tmp_path), progress=False)

    def error(c, t, fast=True) -> float:
        model = build_model(c, t, EngineConfig(fast_path=fast))
        assert (model.fast is not None) == fast
        return (all_position_logits(model, ids, torch.float32) - ref).abs().max().item() / scale

    assert error(cfg, tensors) <= 1e-4 and error(cfg, tensors, fast=False) <= 1e-4
    off = {f: error(*_without(f, cfg, tensors)) for f in features}
    assert min(off.values()) > 0.05, f"{name}: features that do not change the logits: {[f for f, e in off.items() if e <= 0.05]}"


@pytest.mark.parametrize("name", ["qwen3-yarn", "llama-yarn-betas-mscale-untruncated"])
def test_yarn_features_bind(tmp_path, monkeypatch, name):
    """YaRN's two parts each act on a 40-token prompt (past the original context 32): every
    position's logits from our model (fast path and module forward) equal HF's to float32
    rounding, and with its frequency correction taken out (every frequency interpolated, as linear
    scaling would), its attention factor taken out (cos / sin unscaled) or YaRN itself (the
    default rope), they are off by more than 5% of the logits' scale."""
    from pdserve.runtime import rope

    save_tiny_model(tmp_path, **CONFIGS[name])
    hf, ids, ref, scale = hf_reference_logits(tmp_path)
    cfg, tensors = load_checkpoint(str(tmp_path), progress=False)
    assert cfg.rope_scaling.kind == "yarn" and rope.yarn_attention_factor(cfg.rope_scaling) > 1.05

    def error(c, fast=True) -> float:
        model = build_model(c, tensors, EngineConfig(fast_path=fast))
        assert (model.fast is not None) == fast
        return (all_position_logits(model, ids, torch.float32) - ref).abs().max().item() / scale

    assert error(cfg) <= 1e-4 and error(cfg, fast=False) <= 1e-4
    r = dataclasses.replace
    off = {"YaRN (default rope)": error(r(cfg, rope_scaling=RopeScaling())),
           "attention factor": error(r(cfg, rope_scaling=r(cfg.rope_scaling, attention_factor=1.0)))}
    with monkeypatch.context() as m:
        m.setattr(rope, "yarn_extrapolation", lambda s, dim, base: torch.zeros(dim // 2))
        off["frequency correction"] = error(cfg)
    assert min(off.values()) > 0.05, f"{name}: parts that do not change the logits: {off}"


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Hi!",
]


@pytest.fixture(scope="module")
def default_engine():
    # the float32 path is the reference (the default model ships Q4_1; tests/runtime/test_quantized.py
    # holds the quantized path to this one)
    return LLMEngine.load(None, EngineConfig(num_blocks=256, quantization="none"), progress=False)


@pytest.mark.timeout(180)  # measured 20-70 s on 2 cores
@pytest.mark.slow
def test_default_model_matches_hf(default_engine):
    from pdserve.common.tokenizer import render_chat
    from pdserve.runtime.weights import default_model_path

    hf = hf_from_gguf(default_model_path())
    eng = default_engine
    prompts = [render_chat(eng.tokenizer, [{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=48)
    refs = [hf_greedy(hf, p, 48) for p in prompts]
    alone = [eng.generate([p], params)[0] for p in prompts]
    batched = eng.generate(prompts, params)
    compared = 0
    for i, (tokens, logits) in enumerate(refs):
        compared += assert_greedy_equal(alone[i].token_ids, tokens, logits, f"chat {i} alone")
        compared += assert_greedy_equal(batched[i].token_ids, tokens, logits, f"chat {i} in batch")
    assert compared >= 0.9 * 2 * sum(len(t) for t, _ in refs)  # near-ties are rare, not the rule
    assert "Paris" in alone[0].text
    assert eng.blocks.free_blocks == eng.blocks.num_blocks


def test_transformers_sees_hugging_faces_kernels_package_not_ours():
    from transformers.utils import import_utils

    import kernels

    assert import_utils.is_kernels_available() == hasattr(kernels, "CUDAProperties")  # HF's, when installed
    assert not Path(kernels.__file__ or "").is_relative_to(Path(__file__).resolve().parents[2] / "kernels")


def _hf_router_gaps(hf, ids: list[int], top_k: int) -> float:
    """The least gap between the k-th and (k+1)-th router logit (the softmax keeps their order)
    over every token and MoE layer of HF's forward of `ids`: how far the test's routing is from a tie."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    gaps = [p[:, top_k - 1] - p[:, top_k] for p in (r.float().sort(-1, descending=True).values for r in out.router_logits)]
    return min(g.min().item() for g in gaps)


def _moe_off(feature: str, cfg, tensors: dict, monkeypatch):
    """(config, tensors) of our model with one MoE feature taken out (the route patched where it must be)."""
    r = dataclasses.replace
    from pdserve.runtime import moe

    if feature == "routing (dense average of all experts)":
        def dense_average(logits, top_k, norm, float_weights):
            t, e = logits.shape
            return torch.full((t, e), 1.0 / e, dtype=logits.dtype), torch.arange(e).expand(t, e)

        monkeypatch.setattr(moe, "route", dense_average)
        return cfg, tensors
    if feature == "shared expert":
        zero = {k: torch.zeros_like(v) if "shared_expert." in k and "down_proj" in k else v for k, v in tensors.items()}
        return cfg, zero
    return r(cfg, **{"top-1 instead of top-k": dict(experts_per_tok=1), "norm_topk_prob": dict(norm_topk_prob=not cfg.norm_topk_prob),
                     "dense layers": dict(dense_layers=())}[feature]), tensors


@pytest.mark.parametrize("name,features", [
    ("mixtral-window16", ["routing (dense average of all experts)", "top-1 instead of top-k", "norm_topk_prob"]),
    ("qwen3-norm-top3-dense1", ["routing (dense average of all experts)", "top-1 instead of top-k", "norm_topk_prob"]),
    ("qwen2-shared-sparse2", ["routing (dense average of all experts)", "top-1 instead of top-k", "norm_topk_prob", "shared expert"]),
])
def test_moe_features_bind(tmp_path, monkeypatch, name, features):
    """Every position's logits of a 40-token prompt from our model (fast path and module forward)
    equal HF's to float32 rounding; with routing replaced by a dense average of all experts, or
    any other MoE feature taken out, they move by more than 5% of the logits' scale. HF's routing
    of the prompt is at least ROUTER_GAP_TOL (in router logits) from a tie everywhere (float32 rounding cannot flip
    an expert), which the greedy tests above rely on."""

    save_tiny_model(tmp_path, **MOE[name])
    hf, ids, ref, scale = hf_reference_logits(tmp_path)
    cfg, tensors = load_checkpoint(str(tmp_path), progress=False)
    assert cfg.num_experts == 8 and _hf_router_gaps(hf, ids, cfg.experts_per_tok) > ROUTER_GAP_TOL

    def error(c, t, fast=True) -> float:
        model = build_model(c, t, EngineConfig(fast_path=fast))
        assert (model.fast is not None) == fast
        return (all_position_logits(model, ids, torch.float32) - ref).abs().max().item() / scale

    assert error(cfg, tensors) <= 1e-4 and error(cfg, tensors, fast=False) <= 1e-4
    off = {}
    for f in features:
        with monkeypatch.context() as m:
            off[f] = error(*_moe_off(f, cfg, tensors, m))
    assert min(off.values()) > 0.05, f"{name}: features that do not change the logits: {[f for f, e in off.items() if e <= 0.05]}"
