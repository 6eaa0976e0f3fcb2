"""Weight loading: GGUF (every supported quant type, Q/K permutation undone) and HF directories,
and one clear typed error for each kind of bad input, with nothing half-loaded."""
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from pdserve.common.errors import ModelLoadError, UnsupportedModelError
from pdserve.kernels.quant import QuantExperts, QuantTensor
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.weights import default_model_path, load_checkpoint
from pdserve_client.params import SamplingParams
from tests.helpers import assert_greedy_equal, hf_greedy, save_tiny_model, write_gguf


def gguf_decodes_as_hf(gguf, hf_dir, label: str, prompt=(5, 9, 33, 100, 7, 250, 3)) -> int:
    """20 greedy tokens of a prompt from the GGUF through the engine against HF's on the source
    checkpoint: assert_greedy_equal's count of equal tokens (a divergence only at a near-tie)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    eng = LLMEngine.load(gguf, EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
    prompt = list(prompt)
    ref, logits = hf_greedy(hf, prompt, 20, eos=False)
    got = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    return assert_greedy_equal(got, ref, logits, label)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return d


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quant_types_dequantize_and_unpermute(tmp_path, tiny, qtype):
    expected = write_gguf(tmp_path / "m.gguf", tiny, qtype)
    cfg, tensors = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert cfg.num_heads == 4 and cfg.num_kv_heads == 2 and not cfg.tie_embeddings
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(tensors[name].numpy(), want, err_msg=name)


def test_gguf_f32_greedy_matches_hf_on_the_source_checkpoint(tmp_path, tiny):
    """Proves the Q/K un-permutation: the GGUF-loaded model decodes exactly like HF's safetensors one."""

    write_gguf(tmp_path / "m.gguf", tiny, "F32")
    assert gguf_decodes_as_hf(tmp_path / "m.gguf", tiny, "gguf f32") >= 1


def test_qwen3_gguf_greedy_matches_hf(tmp_path):
    """A Qwen3 GGUF as llama.cpp writes it (attn_q_norm / attn_k_norm, key_length 32 while hidden /
    heads is 16, no Q/K permutation) loads to HF's tensors and decodes as HF does."""

    save_tiny_model(tmp_path / "hf", arch="qwen3", head_dim=32)
    expected = write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "F32", arch="qwen3")
    cfg, tensors = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 32 and not cfg.attention_bias
    assert set(tensors) == set(expected) and "model.layers.0.self_attn.q_norm.weight" in tensors
    assert gguf_decodes_as_hf(tmp_path / "m.gguf", tmp_path / "hf", "qwen3 gguf f32") >= 1


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.25},
])
def test_qwen3_yarn_gguf_decodes_as_hf(tmp_path, rope):
    """A YaRN Qwen3 GGUF as llama.cpp's converter writes it (rope.scaling.type yarn, factor,
    original_context_length, yarn_beta_fast / slow and yarn_attn_factor where the config sets
    them; no qwen3.vocab_size, which that converter does not write for Qwen): the HF checkpoint's
    rope scaling and vocabulary size, and greedy decoding as HF's past the original context 32."""
    from pdserve.runtime.config import ModelConfig

    save_tiny_model(tmp_path / "hf", arch="qwen3", head_dim=32, max_position_embeddings=128, rope_parameters=rope)
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "F32", arch="qwen3", vocab_key=False)
    cfg, _ = load_checkpoint(tmp_path / "m.gguf", progress=False)
    hf_cfg = ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert cfg.rope_scaling == hf_cfg.rope_scaling and cfg.rope_scaling.kind == "yarn" and cfg.vocab_size == 512
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    assert gguf_decodes_as_hf(tmp_path / "m.gguf", tmp_path / "hf", "qwen3 yarn gguf", prompt) >= 10


def test_gguf_rope_keys_read_as_llama_cpp_reads_them():
    """rope.scaling.* as llama.cpp reads them: a factor without a type is linear; yarn's original
    context defaults to the context length, yarn_log_multiplier is mscale_all_dim with mscale 1;
    an unsupported type or a rope.scaling.attn_factor other than 1 is refused by name."""
    from pdserve.runtime.config import RopeScaling
    from pdserve.runtime.weights import _gguf_rope

    def rope(**keys):
        return _gguf_rope("qwen3", {f"qwen3.rope.scaling.{k}": v for k, v in keys.items()}, 4096)

    assert rope() == rope(type="none", factor=4.0) == RopeScaling() and rope(factor=2.0) == RopeScaling("linear", 2.0)
    assert rope(type="yarn", factor=4.0) == RopeScaling("yarn", 4.0, original_max_position=4096)
    assert rope(type="yarn", factor=4.0, yarn_log_multiplier=0.5) == RopeScaling("yarn", 4.0, original_max_position=4096, mscale=1.0,
                                                                                 mscale_all_dim=0.5)
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        rope(type="longrope", factor=4.0)
    with pytest.raises(UnsupportedModelError, match="attn_factor"):
        rope(type="yarn", factor=4.0, attn_factor=2.0)
    with pytest.raises(ModelLoadError, match="rope.scaling.factor"):
        rope(type="yarn")


def test_hf_config_windows_per_family():
    """Sliding windows as transformers reads config.json: Mistral on every layer whenever
    sliding_window is set (Mistral-7B-v0.1 has no use_sliding_window key); Qwen2 / Qwen3 only with
    use_sliding_window, on layers from max_window_layers on or as layer_types says; Llama never."""
    from pdserve.runtime.config import ModelConfig

    base = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    cfg = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert cfg.layer_windows == (4096,) * 4 and cfg.windowed and cfg.window(3) == 4096
    assert not ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}).windowed
    assert not ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}).windowed
    qwen = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "use_sliding_window": True,
                                "max_window_layers": 2})
    assert qwen.layer_windows == (0, 0, 16, 16)
    typed = ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 8, "use_sliding_window": True,
                                 "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert typed.layer_windows == (8, 0, 8, 0) and typed.qk_norm
    assert not ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 16}).windowed
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True})


def test_sharded_safetensors_directory(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    full = load_file(str(tiny / "model.safetensors"))
    names = sorted(full)
    half = len(names) // 2
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(tiny / "config.json", d / "config.json")
    save_file({n: full[n] for n in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: full[n] for n in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors" for i, n in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, tensors = load_checkpoint(d, progress=False)
    assert set(tensors) == set(full)
    assert all(torch.equal(tensors[n], full[n]) for n in names)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_truncated_gguf(tmp_path):
    data = default_model_path().read_bytes()
    for cut in (10, 4096, len(data) // 2):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_checkpoint(p, progress=False)


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(p, progress=False)
    p2 = tmp_path / "notgguf.gguf"
    p2.write_bytes(b"hello world" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_checkpoint(p2, progress=False)


def test_unsupported_architecture(tmp_path, tiny):
    d = tmp_path / "gpt2"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(d, progress=False)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'"):
        write_gguf(tmp_path / "g.gguf", tiny, "F32", arch="gpt2")
        load_checkpoint(tmp_path / "g.gguf", progress=False)


def test_unsupported_quant_type(tmp_path, tiny):
    import gguf

    write_gguf(tmp_path / "m.gguf", tiny, "F32")
    # Re-write one tensor as Q8_1 (raw bytes of the right size), a type the gguf package cannot dequantize: the loader must name it.
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    wr = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith("llama.") or k.startswith("tokenizer."):
            v = f.contents()
            if isinstance(v, int):
                wr.add_uint32(k, v)
            elif isinstance(v, float):
                wr.add_float32(k, v)
    for t in r.tensors:
        if t.name == "blk.0.ffn_up.weight":
            wr.add_tensor(t.name, np.zeros((int(t.shape[1]), 80), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            wr.add_tensor(t.name, np.array(t.data))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tensor type.*Q8_1.*cannot dequantize"):
        load_checkpoint(tmp_path / "k.gguf", progress=False)


def test_pickled_weights_are_refused(tmp_path, tiny):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(tiny / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelLoadError, match="pickled"):
        load_checkpoint(d, progress=False)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_phi3_gguf_splits_fused_tensors_and_decodes_as_hf(tmp_path, qtype):
    """A Phi-3 GGUF as llama.cpp writes it (fused attn_qkv and ffn_up holding gate then up, no Q/K
    permutation, no window: llama.cpp and transformers' GGUF loader both ignore it) loads to HF's
    q/k/v and gate/up rows, kept quantized too, and (F32) decodes as HF does without a window."""

    from pdserve.kernels.quant import QuantTensor
    from pdserve.runtime.weights import dequantize_all, split_fused

    save_tiny_model(tmp_path / "hf", arch="phi3")
    expected = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype, arch="phi3").items()}
    cfg, tensors = load_checkpoint(tmp_path / "m.gguf", progress=False, keep_quantized=True)
    assert cfg.architecture == "Phi3ForCausalLM" and not cfg.windowed and not cfg.attention_bias
    split_fused(cfg, expected, "expected")
    assert set(tensors) == set(expected) and "model.layers.0.mlp.gate_proj.weight" in tensors
    assert isinstance(tensors["model.layers.0.self_attn.k_proj.weight"], QuantTensor) == (qtype == "Q8_0")
    for name, got in dequantize_all(tensors).items():
        torch.testing.assert_close(got, expected[name], rtol=0, atol=0, msg=name)
    if qtype != "F32":
        return
    assert gguf_decodes_as_hf(tmp_path / "m.gguf", tmp_path / "hf", "phi3 gguf f32") >= 1


PHI3_BASE = dict(architectures=["Phi3ForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)


def test_phi3_config_reads_window_and_refuses_what_it_does_not_implement():
    """Phi-3 4k (default rope, full rotary, silu; sliding_window on every layer as transformers
    applies it) is read; longrope / su (128k), partial rotary and another activation are refused."""
    from pdserve.runtime.config import ModelConfig

    cfg = ModelConfig.from_hf({**PHI3_BASE, "sliding_window": 2047, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                                        "partial_rotary_factor": 1.0}})
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.layer_windows == (2047, 2047) and cfg.head_dim == 16
    assert not ModelConfig.from_hf({**PHI3_BASE, "sliding_window": None}).windowed
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 4096}
    for rope in ({"rope_scaling": {"type": "su", **factors}}, {"rope_scaling": {"type": "longrope", **factors}},
                 {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, **factors}}):
        with pytest.raises(UnsupportedModelError, match="Phi-3 rope scaling .* not supported"):
            ModelConfig.from_hf({**PHI3_BASE, **rope})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf({**PHI3_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5"):
        ModelConfig.from_hf({**PHI3_BASE, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**PHI3_BASE, "hidden_act": "gelu"})


def test_phi3_128k_checkpoints_are_refused_on_load(tmp_path):
    """A longrope Phi-3 directory and a GGUF holding rope_factors_long / short are refused with a
    clear error, never served with the default rope."""
    save_tiny_model(tmp_path / "hf", arch="phi3")
    write_gguf(tmp_path / "long.gguf", tmp_path / "hf", "F32", arch="phi3", extra={"rope_factors_long.weight": np.ones(8, np.float32),
                                                                                  "rope_factors_short.weight": np.ones(8, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_factors_long.*128k longrope"):
        load_checkpoint(tmp_path / "long.gguf", progress=False)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                              "original_max_position_embeddings": 64}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_checkpoint(tmp_path / "hf", progress=False)


def test_phi3_fused_matrix_of_the_wrong_height_is_refused(tmp_path):
    """A qkv_proj whose rows are not q + k + v heads is refused, not split at the wrong rows."""
    from safetensors.torch import load_file, save_file

    save_tiny_model(tmp_path, arch="phi3")
    w = load_file(str(tmp_path / "model.safetensors"))
    w["model.layers.1.self_attn.qkv_proj.weight"] = w["model.layers.1.self_attn.qkv_proj.weight"][:-16].contiguous()
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="qkv_proj.weight has 112 rows, expected 128"):
        load_checkpoint(tmp_path, progress=False)


GEMMA_GGUF = {  # llama.cpp's assumptions: query_pre_attn_scalar = head_dim; gemma2 slides every 2nd layer, gemma3 5 of 6
    "gemma2": dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=4.0,
                   final_logit_softcapping=4.0, tie_word_embeddings=True),
    "gemma3": dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=32, sliding_window=8, num_hidden_layers=6, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
}


@pytest.mark.parametrize("arch", list(GEMMA_GGUF))
def test_gemma_gguf_loads_as_the_hf_checkpoint_and_decodes_as_hf(tmp_path, arch):
    """A gemma2 / gemma3 GGUF as llama.cpp's converter writes it (norms stored as 1 + w;
    post_attention_norm, ffn_norm as the MLP input's norm, post_ffw_norm; soft-caps, window,
    rope.freq_base_swa and linear scaling in metadata) gives the config and tensors the HF
    directory gives, and decodes as HF does (prompts past the window)."""
    from transformers import AutoModelForCausalLM

    save_tiny_model(tmp_path / "hf", **GEMMA_GGUF[arch])
    expected = write_gguf(tmp_path / "m.gguf", tmp_path / "hf", "F32", arch=arch)
    hf_cfg, hf_tensors = load_checkpoint(tmp_path / "hf", progress=False)
    cfg, tensors = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert cfg.rms_eps == pytest.approx(hf_cfg.rms_eps)  # float32 in a GGUF
    assert dataclasses.replace(cfg, rms_eps=hf_cfg.rms_eps) == hf_cfg, (cfg, hf_cfg)
    assert set(tensors) == set(expected) == set(hf_tensors) - {"lm_head.weight"}
    for name, want in hf_tensors.items():  # the HF loader's (1 + w) norms are what the GGUF stores
        if name != "lm_head.weight":
            torch.testing.assert_close(tensors[name], want.float(), rtol=0, atol=0, msg=name)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    eng = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
    for prompt in ([5, 9, 33, 100, 7, 250, 3], list(range(40, 60))):
        ref, logits = hf_greedy(hf, prompt, 16, eos=False)
        got = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
        assert assert_greedy_equal(got, ref, logits, f"{arch} gguf f32") >= 8


def test_gemma_config_defaults_and_refusals():
    """A config.json read as transformers reads it, older keys included (Gemma 2 without
    layer_types or soft-cap keys: 50 / 30 and every 2nd layer full; Gemma 3 with rope_theta,
    rope_local_base_freq and rope_scaling); what this runtime does not compute refused by name."""
    from pdserve.runtime.config import ModelConfig, RopeScaling

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    g2 = ModelConfig.from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 16})
    assert (g2.attn_softcap, g2.final_softcap, g2.query_pre_attn_scalar, g2.head_dim) == (50.0, 30.0, 256.0, 256)
    assert g2.layer_windows == (16, 0, 16, 0) and g2.tie_embeddings and g2.embed_scale == 8.0 and g2.activation == "gelu_tanh"
    assert g2.norm_plus_one and g2.sandwich_norms and not g2.qk_norm and g2.attention_scale == 256**-0.5
    g3 = ModelConfig.from_hf({**base, "model_type": "gemma3_text", "num_hidden_layers": 7, "head_dim": 16, "rope_theta": 1e6,
                              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert g3.architecture == "Gemma3ForCausalLM" and g3.qk_norm and (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    assert g3.layer_windows == (4096,) * 5 + (0, 4096)
    assert (g3.rope_theta, g3.rope_scaling, g3.rope_local_theta) == (1e6, RopeScaling("linear", 8.0), 1e4)
    assert [g3.local_rope(i) for i in range(7)] == [True] * 5 + [False, True]
    refused = {
        "bidirectional": {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
        "attention_bias": {"architectures": ["Gemma2ForCausalLM"], "attention_bias": True},
        "hidden_activation": {"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"},
        "sliding layers": {"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
        "'longrope'": {"architectures": ["Gemma3ForCausalLM"], "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
        "Gemma3ForConditionalGeneration": {"architectures": ["Gemma3ForConditionalGeneration"]},
    }
    for words, d in refused.items():
        with pytest.raises(UnsupportedModelError, match=words):
            ModelConfig.from_hf({**base, **d})


@pytest.mark.parametrize("arch,gguf_arch,qtype", [("mixtral", "llama", "F32"), ("qwen3_moe", "qwen3moe", "F32"), ("qwen2_moe", "qwen2moe", "F32"),
                                                  ("mixtral", "llama", "Q8_0"), ("qwen2_moe", "qwen2moe", "Q8_0")])
def test_moe_gguf_loads_as_the_hf_checkpoint_and_decodes_as_hf(tmp_path, arch, gguf_arch, qtype):
    """A MoE GGUF as llama.cpp's converter writes it (arch llama with expert_count for Mixtral,
    its Q/K permuted; qwen2moe / qwen3moe; the experts as 3-D ffn_*_exps stacks; Qwen2-MoE's
    ffn_*_shexp and ffn_gate_inp_shexp) loads to the HF checkpoint's config and tensors (quantized
    3-D stacks dequantized at load; 2-D matrices kept as blocks with keep_quantized) and, in F32,
    decodes as HF does."""

    # Qwen3-MoE with norm_topk_prob, as every published one (llama.cpp's qwen3moe graph always renormalises)
    overrides = dict(mlp_only_layers=[1], norm_topk_prob=True) if arch == "qwen3_moe" else {}
    if qtype != "F32":  # expert widths of whole 32-wide blocks
        overrides.update(intermediate_size=64) if arch == "mixtral" else overrides.update(moe_intermediate_size=64)
    save_tiny_model(tmp_path / "hf", arch=arch, **overrides)
    hf_cfg, _ = load_checkpoint(tmp_path / "hf", progress=False)
    expected = write_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtype, arch=gguf_arch)
    cfg, tensors = load_checkpoint(tmp_path / "m.gguf", progress=False)
    assert cfg.architecture == hf_cfg.architecture
    for f in ("num_experts", "experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
              "dense_layers", "attention_bias", "qk_norm"):
        assert getattr(cfg, f) == getattr(hf_cfg, f), f
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        assert torch.allclose(tensors[name], torch.from_numpy(np.ascontiguousarray(want)), atol=1e-6), name
    assert tensors["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, cfg.moe_intermediate_size)
    if qtype != "F32":
        _, kept = load_checkpoint(tmp_path / "m.gguf", progress=False, keep_quantized=True)
        assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], QuantTensor)
        stack = kept["model.layers.0.mlp.experts.gate_proj"]  # 3-D stacks: each expert's blocks (runtime.moe serves them packed)
        assert isinstance(stack, QuantExperts) and stack.qtype == qtype and torch.equal(stack.dequantize(), tensors["model.layers.0.mlp.experts.gate_proj"])
        eng = LLMEngine.load(tmp_path / "m.gguf", EngineConfig(num_blocks=32, block_size=8), progress=False, tokenizer=False)
        assert eng.model.quantized and eng.generate([[5, 9, 33]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
        return
    assert gguf_decodes_as_hf(tmp_path / "m.gguf", tmp_path / "hf", f"{arch} gguf") == 20
