"""The decoder layer is written once (runtime.layer): the module form (runtime.model), the fused
CPU path (runtime.cpu_forward) and a tensor-parallel rank (runtime.tp_model) each build their
parts and run `layer.layer_forward`. Shown three ways: a family whose every option acts (Gemma 2's
soft-caps and sandwich norms, Gemma 3's q/k norms and local RoPE, Qwen2-MoE's routed and shared
experts) gives HF's logits through all three forms; a change to the one layer routine changes
all three forms' logits; and none of the three paths' sources reads a family option itself."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pdserve.runtime import layer
from pdserve.runtime.build import build_model
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.weights import load_checkpoint
from tests.helpers import TPRank, all_position_logits, in_tp_threads, save_tiny_model

FAMILIES = {
    "gemma2": dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
                   final_logit_softcapping=4.0),
    "gemma3": dict(arch="gemma3", head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    "qwen2_moe": dict(arch="qwen2_moe", decoder_sparse_step=2, num_hidden_layers=4),
}
IDS = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()  # past the windows of 8


def tp_logits(path: str, n: int = 2) -> torch.Tensor:
    """Every position's logits from n ranks of one TP group, each a thread of this process;
    rank 0's answer (every rank gathers the same)."""
    cfg, tensors = load_checkpoint(path, progress=False)
    return in_tp_threads(cfg, tensors, EngineConfig(), n, lambda model: all_position_logits(TPRank(model), IDS, torch.float32))[0]


def three_forms(path: str) -> dict[str, torch.Tensor]:
    cfg, tensors = load_checkpoint(path, progress=False)
    fused = build_model(cfg, tensors, EngineConfig())
    modules = build_model(cfg, tensors, EngineConfig(fast_path=False))
    assert fused.fast is not None and modules.fast is None
    return {"modules": all_position_logits(modules, IDS, torch.float32), "fused": all_position_logits(fused, IDS, torch.float32),
            "tp2": tp_logits(path)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_form_gives_hf_logits(tmp_path, family):
    """All positions' logits of a 24-token prompt through the three forms: within float32
    rounding of HF's (the TP ranks' row-parallel sums add in another order)."""
    from transformers import AutoModelForCausalLM

    save_tiny_model(tmp_path, max_position_embeddings=128, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    scale = ref.abs().max().item()
    for form, got in three_forms(str(tmp_path)).items():
        err = (got - ref).abs().max().item() / scale
        assert err <= 1e-4, f"{family} {form}: {err:.2e} of the logits' scale off HF's"


def test_a_change_to_the_one_layer_changes_every_form(tmp_path, monkeypatch):
    """layer_forward with the attention's output dropped (a stand-in for any change to the layer):
    each form's logits move, so each runs the one routine rather than a copy of its own."""
    save_tiny_model(tmp_path, max_position_embeddings=128, **FAMILIES["gemma3"])
    before = three_forms(str(tmp_path))
    original = layer.layer_forward

    class NoAttention:
        """The ops of a form with the attention's o projection output zeroed."""

        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            return getattr(self.ops, name)

        def o(self, p, attn):
            return self.ops.o(p, attn).mul_(0)

    monkeypatch.setattr(layer, "layer_forward", lambda ops, *a: original(NoAttention(ops), *a))
    after = three_forms(str(tmp_path))
    for form in before:
        assert (after[form] - before[form]).abs().max() > 0.05 * before[form].abs().max(), f"{form} does not run runtime.layer.layer_forward"


# the options that change which parts a layer has or how they compute (the widths and the
# activation's name, which picks a function in runtime.layer.activation, are the weights' shapes)
FAMILY_OPTIONS = ("sandwich_norms", "qk_norm", "attn_softcap", "local_rope", "moe", "window", "layer_windows", "rope_local_theta")


@pytest.mark.parametrize("path", ["runtime/model.py", "runtime/cpu_forward.py", "runtime/tp_model.py"])
def test_no_path_reads_a_family_option(path):
    """The three forms read no family option of ModelConfig themselves (runtime.layer does; the
    one-call C step's list of what it lacks is runtime.layer.one_call_blocker): an attribute of
    that name read off a config (cfg / c / full / self.cfg / model.cfg) appears in none."""
    source = (Path(__file__).resolve().parents[2] / path).read_text()
    reads = sorted({f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Attribute) and node.attr in FAMILY_OPTIONS and "cfg" in ast.unparse(node.value)
                    or isinstance(node, ast.Attribute) and node.attr in FAMILY_OPTIONS and ast.unparse(node.value) in ("c", "full")})
    assert not reads, f"{path} reads family options: {reads}"
