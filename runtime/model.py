"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 / 3, SmolLM; Mixtral, Qwen3-MoE and
Qwen2-MoE with their mixture-of-experts MLPs, `MoE`) over a paged KV cache.

Lifecycle: `LlamaModel(cfg, dtype)` allocates nothing big; its modules hold the weights under
transformers' names (each layer's norms those runtime.layer.norm_roles lists for the family).
`load_weights(tensors)` takes the HF-named float tensors from runtime.weights, fuses q/k/v and
gate/up into one matrix each (one GEMM instead of three or two), casts to the model dtype and
builds `parts`, runtime.layer's view of each layer's modules. The model has no layer code of its
own: its module forward runs runtime.layer's one decoder layer (`run_layers` with
runtime.layer.TorchOps), as the fused CPU path and a tensor-parallel rank do with theirs; every
family option (Qwen3's q / k norms, Gemma's scaled embeddings, sandwich norms, GeGLU, soft-caps
and local RoPE table, windows, MoE) is read there. Then `forward(batch, kv)`
runs any mix of sequences in flattened (varlen) form: no padding, each token carries its
position and its slot in the paged cache, each sequence its block table (with KV groups,
runtime.kv_groups, one per group: a layer reads its group's pool slot through its group's table). It writes the new K/V
into the pages and returns float32 logits only for the rows in `batch.logits_indices`.
`enable_fast_path()` (called by the engine after loading) switches `forward` to the fused CPU
path of runtime.cpu_forward where it can run; the module forward below stays its slow twin
(`forward_modules`), which the tests compare it with. Weights given as kernels.quant.QuantTensor
(`--quantization auto` on a GGUF) stay in their blocks: their modules become `QuantLinear`s
(listed by weight name in `quantized`; a fused qkv / gate_up whose parts differ in type, as a
Q4_K_M file's Q4_K q / k and Q6_K v, a `QuantRows` of one QuantLinear per part, named
`...qkv_proj.parts.N.weight`), which the CPU fast path reads directly and the module
forward runs with the Triton weight-only kernel on CUDA (the twin, dequantize + F.linear,
elsewhere). A MoE layer's expert stacks given as kernels.quant.QuantExperts stay in their blocks
too (`QuantExpertStack`, its bytes buffers counted by `weight_bytes`): each chosen expert is
multiplied from its own blocks (runtime.moe), never the whole stack.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.quant import QuantTensor
from pdserve.kernels.torch_paged import soft_cap
from pdserve.runtime.blocks import ExpertBlocks, MixedBlocks, QuantExpertStack, QuantLinear, QuantRows, _float, _stack_rows, moe_tensors  # noqa: F401 (re-exported: the model's weight forms)
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.layer import (
    MODULE_NAMES,
    TorchOps,
    activation,
    build_layers,
    embedding_scale,
    gated_mlp,
    has_shared_expert,
    is_moe,
    kv_views,
    norm_roles,
    rope_tables,
    run_layers,
)
from pdserve.runtime.moe import MoEBlock


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64, block_id * block_size + offset
    query_start_loc: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor  # (B,) int32, context length after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32
    max_query_len: int
    logits_indices: torch.Tensor  # (N,) int64 rows of T whose logits are wanted
    # a model with KV groups (runtime.kv_groups: sliding layers beside full ones), each group's own
    # slots and tables, group 0's also in slot_mapping / block_tables; None: one group
    group_slots: torch.Tensor | None = None  # (G, T) int64
    group_tables: torch.Tensor | None = None  # (G, B, max_blocks) int32

    def group_batches(self) -> list[ForwardBatch]:
        """The batch as each KV group's layers see it (its slots and tables); [] for one group."""
        if self.group_slots is None:
            return []
        return [replace(self, slot_mapping=s, block_tables=t, group_slots=None, group_tables=None)
                for s, t in zip(self.group_slots, self.group_tables, strict=True)]


class RMSNorm(nn.Module):
    """weight * normalised x. float_scale (Gemma): the product in float32, then cast, as Gemma's
    RMSNorm takes it (its weight holds the 1 + w it scales by, runtime.weights.add_one_to_norms);
    else cast first, as Llama's. The two agree bit for bit in float32."""

    def __init__(self, dim: int, eps: float, float_scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.float_scale = float_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm (Gemma: Gemma2RMSNorm), so float32 results are bit-identical.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float_scale:
            return (x * self.weight.float()).to(dtype)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """The attention's projections (q/k/v fused into one) and, for Qwen3 / Gemma 3, its per-head
    q_norm / k_norm (DecoderLayer adds them); runtime.layer computes it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, inter: int | None = None):
        super().__init__()
        self.inter = inter or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.act = activation(cfg.activation)

    def forward(self, x):  # Qwen2-MoE's shared expert (a dense layer's MLP runs as runtime.layer's parts)
        return gated_mlp(self.gate_up_proj, self.down_proj, self.act, x)


class MoE(nn.Module):
    """A mixture-of-experts MLP (runtime.moe): the router `gate` (E, hidden), the experts' gate
    and up rows stacked per expert (E, 2 I, hidden) and their down matrices (E, hidden, I), float
    parameters or, from a GGUF loaded with keep_quantized, QuantExpertStack modules over their
    blocks; for Qwen2-MoE a shared expert (an MLP) scaled by sigmoid(shared_expert_gate). Only the
    chosen experts' slices are read (runtime.moe.experts_grouped; `dense` True: the dense twin)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = nn.Linear(h, e, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        s = cfg.shared_expert_intermediate_size if has_shared_expert(cfg) else 0
        self.shared_expert = MLP(cfg, s) if s else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if s else None
        self.dense = False

    def forward(self, x):
        block = MoEBlock(self.cfg, self.gate.weight, self.experts_gate_up, self.experts_down, self.shared_expert,
                         None if self.shared_expert_gate is None else self.shared_expert_gate.weight)
        block.dense = self.dense
        return block(x)


class DecoderLayer(nn.Module):
    """One layer's weights as modules, named as transformers names them: its norms are those
    runtime.layer.norm_roles lists for the family (the per-head q / k norms in self_attn), its MLP
    an MLP or a MoE. It has no forward of its own: runtime.layer.layer_forward runs its parts."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if is_moe(cfg, layer) else MLP(cfg)
        roles = norm_roles(cfg)
        for name in roles.names():
            owner, _, attr = name.rpartition(".")
            dim = cfg.head_dim if name in (roles.q, roles.k) else cfg.hidden_size
            setattr(self.get_submodule(owner), attr, RMSNorm(dim, cfg.rms_eps, cfg.norm_plus_one))


class ModuleParts:
    """runtime.layer's builder for the module form: a layer's parts are its own modules."""

    def __init__(self, model: LlamaModel):
        self.model = model

    def norm(self, i: int, name: str):
        return self.model.layers[i].get_submodule(name)

    head_norm = norm

    def linear(self, i: int, role: str):
        return self.model.layers[i].get_submodule(MODULE_NAMES[role])

    def moe(self, i: int, shared: bool):
        return self.model.layers[i].mlp

    def rope(self, local: bool):
        return self.model.rope_local if local else self.model.rope

    def activation(self, name: str):
        return activation(name)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, attention_backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.attention_backend = attention_backend
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_plus_one)
        self.lm_head = self.embed_tokens if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope, self.rope_local = rope_tables(cfg)  # rope_local: Gemma 3's sliding layers' table (or None)
        self.requires_grad_(False)
        self.fast = None  # a runtime.cpu_forward.CpuForward once enable_fast_path() succeeds
        self.quantized: dict[str, QuantTensor] = {}  # weight name -> its GGUF blocks (a QuantLinear module holds them)
        self.parts = build_layers(cfg, ModuleParts(self))  # runtime.layer's view of the layers (rebuilt by load_weights)

    def weight(self, name: str) -> torch.Tensor | QuantTensor:
        """A parameter by name, or its QuantTensor where the model keeps it quantized."""
        q = self.quantized.get(name)
        return q if q is not None else self.get_parameter(name)

    def weight_bytes(self) -> int:
        """Bytes the weights occupy (a quantized matrix counts its blocks)."""
        dense = sum(p.numel() * p.element_size() for n, p in self.named_parameters() if n not in self.quantized)
        experts = sum(m.nbytes for m in self.modules() if isinstance(m, QuantExpertStack))
        return dense + sum(q.nbytes for q in self.quantized.values()) + experts

    def enable_fast_path(self, linear_kind: str = "auto", activations: str = "float") -> bool:
        """Run `forward` through the fused CPU path where it can; True if it is on."""
        from pdserve.runtime.cpu_forward import CpuForward

        self.fast = CpuForward.build(self, linear_kind, activations)
        return self.fast is not None

    @torch.inference_mode()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be covered."""
        fused = {"embed_tokens.weight": tensors["model.embed_tokens.weight"], "norm.weight": tensors["model.norm.weight"]}
        if not self.cfg.tie_embeddings:
            fused["lm_head.weight"] = tensors["lm_head.weight"]
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            fused[f"layers.{i}.self_attn.qkv_proj.weight"] = _stack_rows([tensors[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
            if self.cfg.attention_bias:
                fused[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat([tensors[a + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
            fused[f"layers.{i}.self_attn.o_proj.weight"] = tensors[a + "o_proj.weight"]
            for norm in norm_roles(self.cfg).names():
                fused[f"layers.{i}.{norm}.weight"] = tensors[p + norm + ".weight"]
            if is_moe(self.cfg, i):
                fused.update(moe_tensors(tensors, p, f"layers.{i}.mlp.", has_shared_expert(self.cfg)))
            else:
                fused[f"layers.{i}.mlp.gate_up_proj.weight"] = _stack_rows([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
                fused[f"layers.{i}.mlp.down_proj.weight"] = tensors[p + "mlp.down_proj.weight"]
        params = dict(self.named_parameters())
        if set(params) != set(fused):
            raise ValueError(f"weight names do not cover the model: {sorted(set(params) ^ set(fused))[:3]}")
        for name, param in params.items():
            src = fused[name]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(param.shape)}")
            if isinstance(src, ExpertBlocks):  # a MoE stack in blocks: the parameter becomes a QuantExpertStack
                parent, _, child = name.rpartition(".")
                owner = self.get_submodule(parent)
                delattr(owner, child)
                setattr(owner, child, QuantExpertStack(src))
                continue
            if isinstance(src, (QuantTensor, MixedBlocks)):  # the module becomes a QuantLinear over the blocks (QuantRows: over each part's)
                owner, _, _ = name.rpartition(".")
                bias_name = owner + ".bias"
                bias = fused[bias_name].to(self.dtype).contiguous() if bias_name in fused else None
                swapped = QuantLinear(src, bias) if isinstance(src, QuantTensor) else QuantRows(src, bias)
                parent, _, child = owner.rpartition(".")
                setattr(self.get_submodule(parent) if parent else self, child, swapped)
                if owner == "embed_tokens" and self.cfg.tie_embeddings:
                    self.lm_head = swapped
                continue
            if name.endswith(".bias") and isinstance(fused.get(name[:-5] + ".weight"), (QuantTensor, MixedBlocks)):
                continue  # taken by the QuantLinear above
            keep_float = self.cfg.norm_plus_one and name.endswith("norm.weight")  # Gemma's (1 + w), float32 as it scales
            param.data = src.to(torch.float32 if keep_float else self.dtype).contiguous()
        self.quantized = self._blocks()
        self.parts = build_layers(self.cfg, ModuleParts(self))  # some modules became QuantLinears

    def _blocks(self) -> dict[str, QuantTensor]:
        return {f"{n}.weight": m.blocks for n, m in self.named_modules() if isinstance(m, QuantLinear)}

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.quantized = self._blocks()  # .to(device) moved the blocks' buffers
        return out

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(batch, kv_cache)
        return self.forward_modules(batch, kv_cache)

    @torch.inference_mode()
    def forward_modules(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        # kv_cache: (layers of a KV group, 2, num_blocks, block_size, KVH, D)
        if isinstance(self.embed_tokens, QuantLinear):
            h = self.embed_tokens.rows(batch.input_ids, self.dtype)
        else:
            h = self.embed_tokens(batch.input_ids)  # (T, hidden)
        scale = embedding_scale(self.cfg, h.dtype)
        if scale is not None:
            h = h * scale.to(h.device)
        ops = TorchOps(self.cfg, batch, self.attention_backend)
        delta = run_layers(ops, self.parts, h, kv_views(self.cfg, kv_cache))
        h = ops.final_norm(delta, h, batch.logits_indices, self.norm)  # (N, hidden): the final norm is per row
        if isinstance(self.lm_head, QuantLinear):
            return soft_cap(self.lm_head(h), self.cfg.final_softcap).float()
        return soft_cap(F.linear(h, self.lm_head.weight), self.cfg.final_softcap).float()  # (N, vocab)
