"""Mixture-of-experts layers (runtime.moe): the grouped path against its dense twin, the fast
path reading only the chosen experts, the config fields and refusals, and the checkpoint names
(HF's per-expert names and transformers 5's fused 3-D experts). Greedy equality with HF is in
test_hf_equivalence.py (MOE), the fused CPU path step by step in test_cpu_forward.py, TP in
test_tp.py, GGUF in test_weights.py."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.errors import ModelLoadError, UnsupportedModelError
from pdserve.runtime import moe
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.engine import build_model
from pdserve.runtime.weights import load_checkpoint
from tests.helpers import all_position_logits, save_tiny_model


@pytest.mark.parametrize("tokens,top_k,norm", [(0, 2, True), (1, 2, True), (7, 1, False), (33, 3, False), (33, 8, True)])
def test_grouped_experts_equal_the_dense_twin(tokens, top_k, norm):
    g = torch.Generator().manual_seed(tokens + top_k)
    e, h, i = 8, 32, 24
    x = torch.randn(tokens, h, generator=g)
    router, gate_up, down = torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) / 4, torch.randn(e, h, i, generator=g) / 4
    weights, ids = moe.route(x @ router.T, top_k, norm, float_weights=False)
    assert ids.shape == (tokens, top_k) and (not norm or tokens == 0 or torch.allclose(weights.sum(-1), torch.ones(tokens)))
    touched = []
    fast = moe.experts_grouped(x, weights, ids, gate_up, down, touched=touched)
    slow = moe.experts_dense(x, weights, ids, gate_up, down)
    assert fast.shape == slow.shape == x.shape and torch.allclose(fast, slow, rtol=1e-5, atol=1e-5 * max(1.0, slow.abs().amax().item() if tokens else 1.0))
    assert sorted(touched) == sorted(set(ids.flatten().tolist()))  # each chosen expert once, no other


def test_route_is_transformers_router():
    """Mixtral's (softmax, top-k, renormalise: its softmax over the top-k logits) and Qwen's
    (softmax, top-k, optionally renormalised, cast to the model dtype) routing."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.5, 0.0, 4.0]])
    w, ids = moe.route(logits, 2, True, True)
    # a tie (0.5, 0.5) broken as transformers' torch.topk over the float32 probabilities breaks it
    assert ids.tolist() == torch.topk(torch.softmax(logits.float(), -1), 2).indices.tolist() and ids[0].tolist() == [1, 2]
    top = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(w[0], top)
    w, _ = moe.route(logits.bfloat16(), 2, False, False)
    assert w.dtype == torch.bfloat16 and torch.allclose(w[0].float(), torch.softmax(logits[0], -1)[[1, 2]], atol=1e-2)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    save_tiny_model(path, arch="mixtral")
    return path


def logits_and_chosen_experts(model, ids: list[int], monkeypatch) -> tuple[torch.Tensor, list[set[int]]]:
    """All positions' logits of `ids`, and the experts the router chose in each MoE layer while
    computing them (moe.route recorded for that one forward)."""
    chosen, route = [], moe.route

    def recording(*args):
        weights, experts = route(*args)
        chosen.append(set(experts.flatten().tolist()))
        return weights, experts

    monkeypatch.setattr(moe, "route", recording)
    logits = all_position_logits(model, ids, torch.float32)
    monkeypatch.setattr(moe, "route", route)
    return logits, chosen


def test_fast_path_reads_only_the_chosen_experts(mixtral, monkeypatch):
    """One decode-shaped step (a lone token) and a 3-token prompt: every expert no token chose is
    overwritten with NaN, in every MoE layer; the fast path's logits stay finite and equal (it never
    read them), while the dense twin's turn NaN (it reads every expert)."""
    cfg, tensors = load_checkpoint(str(mixtral), progress=False)
    model = build_model(cfg, tensors, EngineConfig())
    assert model.fast is not None
    for ids in ([77], [5, 300, 41]):
        before, chosen = logits_and_chosen_experts(model, ids, monkeypatch)
        assert len(chosen) == cfg.num_layers
        saved = [(layer.mlp.experts_gate_up.clone(), layer.mlp.experts_down.clone()) for layer in model.layers]
        unread = 0
        with torch.inference_mode():  # in place: the fast path holds these same tensors
            for layer, used in zip(model.layers, chosen):
                for e in set(range(cfg.num_experts)) - used:
                    layer.mlp.experts_gate_up[e] = float("nan")
                    layer.mlp.experts_down[e] = float("nan")
                    unread += 1
        assert unread >= cfg.num_layers * (cfg.num_experts - cfg.experts_per_tok * len(ids))
        after = all_position_logits(model, ids, torch.float32)
        assert torch.isfinite(after).all() and torch.equal(after, before)
        for layer in model.fast.layers:
            layer.moe.dense = True
        assert torch.isnan(all_position_logits(model, ids, torch.float32)).all()
        with torch.inference_mode():
            for layer, fast, (gu, d) in zip(model.layers, model.fast.layers, saved):
                fast.moe.dense = False
                layer.mlp.experts_gate_up.copy_(gu)
                layer.mlp.experts_down.copy_(d)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_model_grouped_path_equals_dense_twin(tmp_path, arch):
    """All positions' logits of a 30-token prompt: grouped experts (fast path, module forward) and
    the dense twin agree to float32 rounding."""
    save_tiny_model(tmp_path, arch=arch)
    cfg, tensors = load_checkpoint(str(tmp_path), progress=False)
    ids = list(range(3, 33))
    fast = build_model(cfg, tensors, EngineConfig())
    slow = build_model(cfg, tensors, EngineConfig(fast_path=False))
    got = [all_position_logits(m, ids, torch.float32) for m in (fast, slow)]
    for layer in fast.fast.layers:
        layer.moe.dense = True
    for layer in slow.layers:
        layer.mlp.dense = True
    twin = [all_position_logits(m, ids, torch.float32) for m in (fast, slow)]
    scale = twin[1].abs().max().item()
    for a in (*got, twin[0]):
        assert (a - twin[1]).abs().max().item() <= 1e-5 * scale


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
    return {**base, **kw}


def test_config_fields_and_refusals():
    m = ModelConfig.from_hf(_cfg(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2, sliding_window=8))
    assert (m.num_experts, m.experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (4, 2, 48, True)
    assert m.layer_windows == (8,) * 4 and all(m.moe(i) for i in range(4)) and m.router_weights_float
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    q3 = ModelConfig.from_hf(_cfg(model_type="qwen3_moe", num_local_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
                                  norm_topk_prob=True, mlp_only_layers=[0], use_sliding_window=True, sliding_window=8))
    assert (q3.num_experts, q3.experts_per_tok, q3.moe_intermediate_size, q3.dense_layers, q3.qk_norm) == (6, 3, 16, (0,), True)
    assert q3.layer_windows == (8,) * 4 and not q3.router_weights_float and not q3.attention_bias
    q2 = ModelConfig.from_hf(_cfg(architectures=["Qwen2MoeForCausalLM"], num_experts=8, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=40, decoder_sparse_step=2))
    assert q2.dense_layers == (0, 2) and [q2.moe(i) for i in range(4)] == [False, True, False, True]
    assert q2.shared_expert_intermediate_size == 40 and q2.attention_bias and not q2.norm_topk_prob and q2.experts_per_tok == 4
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf(_cfg(architectures=["MixtralForCausalLM"], hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_hf(_cfg(architectures=["Qwen3MoeForCausalLM"], attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="experts_per_tok"):
        ModelConfig.from_hf(_cfg(architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=3))


def test_fused_3d_experts_load_as_the_per_expert_names(tmp_path):
    """transformers 5's fused parameters (`mlp.experts.gate_up_proj` (E, 2 I, hidden), `down_proj`
    (E, hidden, I)) give the same stacks as the per-expert names HF writes; a missing expert and a
    stack of the wrong shape are refused before anything loads."""
    save_tiny_model(tmp_path / "hf", arch="qwen3_moe")
    cfg, want = load_checkpoint(str(tmp_path / "hf"), progress=False)
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    fused = {}
    for name, t in w.items():
        if ".mlp.experts." not in name:
            fused[name] = t
    for i in range(cfg.num_layers):
        e = f"model.layers.{i}.mlp.experts."
        stack = [torch.stack([w[f"{e}{x}.{n}.weight"] for x in range(cfg.num_experts)]) for n in ("gate_proj", "up_proj", "down_proj")]
        fused[e + "gate_up_proj"], fused[e + "down_proj"] = torch.cat(stack[:2], 1), stack[2]
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(fused, str(out / "model.safetensors"))
    _, got = load_checkpoint(str(out), progress=False)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    del fused["model.layers.1.mlp.experts.gate_up_proj"]
    fused["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(cfg.num_experts, 3, cfg.hidden_size)
    save_file(fused, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="gate_up_proj has shape"):
        load_checkpoint(str(out), progress=False)
    del w["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="expert 5's up_proj in layer 2"):
        load_checkpoint(str(out), progress=False)
    cfg_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg_json["architectures"] == ["Qwen3MoeForCausalLM"]
