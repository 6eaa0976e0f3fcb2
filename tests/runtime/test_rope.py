"""RoPE scaling computed as transformers computes it: every supported rope type's inverse
frequencies and attention factor equal, bit for bit, what transformers' rope init function
returns for the same config.json (modeling_rope_utils); the config keys read as transformers reads
them; what is not supported refused by name before anything loads."""
import pytest
import torch

from pdserve.common.errors import UnsupportedModelError
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.rope import RotaryEmbedding, inv_frequencies

BASE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
            rope_theta=1000000.0)

ROPES = {
    "qwen3 model card": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2},
    "yarn untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "truncate": False},
    "yarn mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "mscale": 0.707, "mscale_all_dim": 0.5},
    "yarn attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.5},
    "yarn factor from lengths": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512},
    "yarn factor 1": {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096},
    "yarn type key": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


def hf_rope(config: dict) -> tuple[torch.Tensor, float]:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, torch.device("cpu"))


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_frequencies_and_attention_factor_equal_transformers(name):
    config = {**BASE, "rope_scaling": dict(ROPES[name])}
    ref_freq, ref_factor = hf_rope(config)
    cfg = ModelConfig.from_hf(config)
    freq, factor = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
    assert torch.equal(freq, ref_freq) and factor == ref_factor, (name, (freq - ref_freq).abs().max(), factor, ref_factor)


def test_yarn_reads_what_transformers_reads():
    """The Qwen3 model card's keys; a top-level original_max_position_embeddings wins over the
    dict's (transformers' standardize_rope_params); without a factor: max / original."""
    cfg = ModelConfig.from_hf({**BASE, "rope_scaling": ROPES["qwen3 model card"]}).rope_scaling
    assert (cfg.kind, cfg.factor, cfg.original_max_position, cfg.beta_fast, cfg.beta_slow, cfg.truncate) == ("yarn", 4.0, 1024, 32, 1, True)
    top = ModelConfig.from_hf({**BASE, "original_max_position_embeddings": 2048, "rope_scaling": ROPES["qwen3 model card"]})
    assert top.rope_scaling.original_max_position == 2048
    assert ModelConfig.from_hf({**BASE, "rope_scaling": ROPES["yarn factor from lengths"]}).rope_scaling.factor == 8.0
    for d in ({**BASE, "rope_scaling": ROPES["qwen3 model card"]}, {**BASE, "original_max_position_embeddings": 2048,
                                                                      "rope_scaling": ROPES["qwen3 model card"]}):
        ref_freq, ref_factor = hf_rope(d)
        cfg = ModelConfig.from_hf(d)
        assert torch.equal(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)[0], ref_freq)


def test_the_attention_factor_scales_the_tables():
    """cos / sin carry YaRN's attention factor, as transformers' rotary embedding applies it, so
    every path reading the tables (module forward, fused CPU step) applies it too."""
    s = ModelConfig.from_hf({**BASE, "rope_scaling": ROPES["yarn attention_factor"]}).rope_scaling
    rope = RotaryEmbedding(32, 64, 1e6, s)
    assert torch.allclose(rope.cos.square() + rope.sin.square(), torch.full((64, 32), 1.5**2))


@pytest.mark.parametrize("rope,words", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16, "original_max_position_embeddings": 1024},
     "unsupported rope scaling type 'longrope'"),
    ({"rope_type": "proportional", "factor": 2.0}, "'proportional'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": -1.0}, "attention_factor"),
])
def test_unsupported_rope_is_refused_by_name(rope, words):
    with pytest.raises(UnsupportedModelError, match=words):
        ModelConfig.from_hf({**BASE, "rope_scaling": rope})
