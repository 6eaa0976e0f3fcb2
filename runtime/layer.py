"""The decoder layer, written once for every execution form, and the family options it reads.

Lifecycle: nothing big is built here. Each execution form builds, once after its weights are
loaded, one `LayerParts` per layer with `build_layers(cfg, make)`, where `make` is the form's
builder (it answers with its own objects for a layer's norms, projections, MoE block, RoPE table
and activation):
- runtime.model (`ModuleParts`): nn.Modules, the slow twin (bit-equal to transformers in float32)
  and the CUDA path; its step runs `TorchOps`;
- runtime.cpu_forward: kernels.linear.PackedLinears and the fused C kernels (`FusedOps`, in that
  module: in-place residual, fused add + RMSNorm, RoPE fused with the KV write, C decode attention);
- runtime.tp_model: one tensor-parallel rank's shards; its step runs `TorchOps` with `reduce` an
  all-reduce (after o, and after the MLP or MoE).
Every family option (ModelConfig) a layer has is read here and nowhere else: which norms a layer
has (`norm_roles`: Gemma's sandwich norms, Qwen3 / Gemma 3's per-head q / k norms), MoE or dense
MLP (Mixtral, Qwen-MoE; Qwen2-MoE's shared expert), the activation (SiLU or Gemma's GeGLU), the
sliding window, the attention soft-cap (Gemma 2) and the RoPE table (Gemma 3's local one for its
sliding layers). Every step a form makes its ops object (its kernels, holding the step's batch
and scratch) and calls `run_layers(ops, parts, h, kv_views)`: `layer_forward`'s sequence of parts
for each layer, the residual stream h updated in place (`add_norm`: h += delta, then the norm of
h, which the CPU form fuses into one C call), each layer's output added at the next layer's
input norm (or at the final norm, `ops.final_norm`). Each layer's pages are its KV group's slot
of the pool (`kv_views`, runtime.kv_groups); with several groups `run_layers` first points the
ops at the layer's group's slots and tables (`ops.use_group`). The one-call C decode step
(kernels/csrc/step_ops.c) computes the plain Llama layer only; `one_call_blocker` names the
options it lacks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import paged
from pdserve.runtime.config import ModelConfig, RopeScaling
from pdserve.runtime.rope import RotaryEmbedding

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a dense layer's projections (a MoE layer has qkv and o)
# the module form's (runtime.model's) name of each, under layers.i. (q / k / v and gate / up fused)
MODULE_NAMES = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}


@dataclass(frozen=True)
class NormRoles:
    """Each of a layer's norms by what it normalises, as the checkpoint names it under
    `model.layers.i.` (None: the layer has no such norm)."""

    attn_in: str  # the attention's input (fused with the residual add)
    mlp_in: str  # the MLP's input (fused with the residual add)
    attn_out: str | None  # Gemma: the attention's output, before it joins the residual stream
    mlp_out: str | None  # Gemma: the MLP's output, likewise
    q: str | None  # Qwen3, Gemma 3: each head of q, before RoPE
    k: str | None

    def names(self) -> list[str]:
        return [n for n in (self.attn_in, self.mlp_in, self.attn_out, self.mlp_out, self.q, self.k) if n is not None]


def norm_roles(cfg: ModelConfig) -> NormRoles:
    """With sandwich_norms (Gemma) post_attention_layernorm is the attention output's norm and
    pre_feedforward_layernorm the MLP input's (transformers' names); else post_attention_layernorm
    is the MLP input's."""
    sandwich, qk = cfg.sandwich_norms, cfg.qk_norm
    return NormRoles("input_layernorm", "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm",
                     "post_attention_layernorm" if sandwich else None, "post_feedforward_layernorm" if sandwich else None,
                     "self_attn.q_norm" if qk else None, "self_attn.k_norm" if qk else None)


def is_moe(cfg: ModelConfig, i: int) -> bool:
    """Whether layer i's MLP is a mixture of experts."""
    return cfg.moe(i)


def has_shared_expert(cfg: ModelConfig) -> bool:
    """Qwen2-MoE: a dense shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate)."""
    return cfg.shared_expert_intermediate_size > 0


def activation(name: str):
    """The MLP's gate activation by ModelConfig.activation: SiLU, or GELU's tanh form (gelu_pytorch_tanh)."""
    return F.silu if name == "silu" else functools.partial(F.gelu, approximate="tanh")


def gated_mlp(gate_up, down, act, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate) * up) with (gate, up) = gate_up(x): a dense MLP in torch (the module form's
    MLP, and Qwen2-MoE's shared expert in every form)."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(act(gate) * up)


def rope_tables(cfg: ModelConfig, device="cpu") -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The model's RoPE table and Gemma 3's local one (its sliding layers', unscaled; None where no layer uses it)."""
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling).to(device)
    local = any(cfg.local_rope(i) for i in range(cfg.num_layers))
    return rope, RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_local_theta, RopeScaling()).to(device) if local else None


def embedding_scale(cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """Gemma: the embeddings times sqrt(hidden), rounded to the model dtype as transformers does (None: no scale)."""
    return torch.tensor(cfg.embed_scale, dtype=torch.float32).to(dtype) if cfg.embed_scale != 1.0 else None


def one_call_blocker(cfg: ModelConfig) -> str | None:
    """What in this model the one-call C decode step (kernels/csrc/step_ops.c, the Llama layer:
    norm, qkv, one RoPE table, C attention, o, add + norm, SwiGLU, down) does not compute, or
    None. Such a model decodes through the per-op loop, its twin. The attention scale, the
    embedding scale and the final soft-cap lie outside the layers' C code (an argument, or
    before and after it), so they do not block it."""
    if cfg.qk_norm:
        return "per-head q/k norms (Qwen3, Gemma 3)"
    if cfg.sandwich_norms:
        return "norms on the attention and MLP outputs (Gemma)"
    if cfg.activation != "silu":
        return f"the {cfg.activation} MLP activation (Gemma's GeGLU)"
    if cfg.attn_softcap:
        return "attention soft-capping (Gemma 2)"
    if any(cfg.local_rope(i) for i in range(cfg.num_layers)):
        return "a second RoPE table for the sliding layers (Gemma 3)"
    if cfg.num_experts:
        return "mixture-of-experts layers (Mixtral, Qwen-MoE; the C step's MLP is dense)"
    if cfg.kv_groups.split:
        return "KV groups (sliding layers beside full ones, runtime.kv_groups: the C step reads one block table for every layer)"
    return None


class LayerParts:
    """One decoder layer's parts in one execution form's own types (a norm: an RMSNorm module or
    a weight tensor; a projection: a module or a PackedLinear; ...), with the layer's attention
    options read once. The layer routine tests only which parts are present."""

    __slots__ = ("index", "check", "attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm",
                 "qkv", "o", "gate_up", "down", "act", "moe", "rope", "window", "softcap", "kv_group")

    def linears(self) -> list:
        """The projections (MoE: qkv, o and the shared expert's; the routed experts are read by expert)."""
        shared = getattr(self.moe, "shared", None) if self.moe is not None else None
        extra = [shared.gate_up, shared.down] if isinstance(shared, GatedMLP) else []
        return [x for x in (self.qkv, self.o, self.gate_up, self.down) if x is not None] + extra


class GatedMLP:
    """A dense gated MLP over two projection callables (Qwen2-MoE's shared expert in the CPU and TP forms)."""

    def __init__(self, gate_up, down, act):
        self.gate_up, self.down, self.act = gate_up, down, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.gate_up, self.down, self.act, x)


def build_layers(cfg: ModelConfig, make) -> list[LayerParts]:
    """Every layer's parts from the form's builder `make`, which provides norm(i, name),
    head_norm(i, name) (q / k), linear(i, role in PROJECTIONS), moe(i, shared: bool), rope(local: bool)
    and activation(name); cfg: the form's (a rank's share of heads and widths under TP)."""
    roles = norm_roles(cfg)
    layers = []
    for i in range(cfg.num_layers):
        p = LayerParts()
        p.index, p.check = i, i == 0  # the CPU kernels check the first layer's tensors (the others' are alike)
        p.attn_norm, p.mlp_norm = make.norm(i, roles.attn_in), make.norm(i, roles.mlp_in)
        p.attn_out_norm = make.norm(i, roles.attn_out) if roles.attn_out else None
        p.mlp_out_norm = make.norm(i, roles.mlp_out) if roles.mlp_out else None
        p.q_norm = make.head_norm(i, roles.q) if roles.q else None
        p.k_norm = make.head_norm(i, roles.k) if roles.k else None
        p.qkv, p.o = make.linear(i, "qkv"), make.linear(i, "o")
        p.moe = make.moe(i, has_shared_expert(cfg)) if is_moe(cfg, i) else None
        p.gate_up, p.down = (None, None) if p.moe is not None else (make.linear(i, "gate_up"), make.linear(i, "down"))
        p.act = make.activation(cfg.activation)
        p.rope = make.rope(cfg.local_rope(i))
        p.window = cfg.window(i)  # sliding window in keys (0: full attention)
        p.softcap = cfg.attn_softcap  # Gemma 2 (0: none)
        p.kv_group = cfg.kv_groups.group_of[i] if cfg.kv_groups.split else None  # its block tables' group (None: the one table)
        layers.append(p)
    return layers


def layer_forward(ops, p: LayerParts, h: torch.Tensor, delta, k_cache, v_cache):
    """One decoder layer: h is the residual stream (T, hidden), delta the previous layer's output
    not yet added to it (None before the first layer); returns this layer's output, not yet added."""
    x = ops.add_norm(p, delta, h, p.attn_norm)
    qkv = ops.qkv(p, x)
    if p.q_norm is not None:
        qkv = ops.qk_norm(p, qkv)
    q = ops.rope_write_kv(p, qkv, k_cache, v_cache)
    a = ops.reduce(ops.o(p, ops.attention(p, q, k_cache, v_cache)))
    if p.attn_out_norm is not None:
        a = ops.norm(p, a, p.attn_out_norm)
    x = ops.add_norm(p, a, h, p.mlp_norm)
    m = ops.reduce(ops.moe(p, x) if p.moe is not None else ops.down(p, ops.act_mul(p, ops.gate_up(p, x))))
    if p.mlp_out_norm is not None:
        m = ops.norm(p, m, p.mlp_out_norm)
    return m


def run_layers(ops, layers: list[LayerParts], h: torch.Tensor, kv_views) -> torch.Tensor:
    """Every layer in turn; returns the last one's output (the caller's ops.final_norm adds it).
    A layer of a KV group (runtime.kv_groups) first points ops at its group's slots and tables."""
    delta = None
    for p, (k_cache, v_cache) in zip(layers, kv_views):
        if p.kv_group is not None:
            ops.use_group(p.kv_group)
        delta = layer_forward(ops, p, h, delta, k_cache, v_cache)
    return delta


def kv_views(cfg: ModelConfig, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (k_cache, v_cache) pages: its slot of the pool (cfg.kv_groups; layer i's own
    slot i when the layers form one group)."""
    return [(kv_cache[s, 0], kv_cache[s, 1]) for s in cfg.kv_groups.slot_of]


class TorchOps:
    """The parts in torch as transformers computes them (bit-equal in float32): the module form's
    and a tensor-parallel rank's (`reduce`: its all-reduce; here none). One per step."""

    __slots__ = ("c", "batch", "backend", "reduce", "groups")

    def __init__(self, cfg: ModelConfig, batch, backend: str, reduce=None):
        self.c, self.batch, self.backend = cfg, batch, backend
        self.reduce = _same if reduce is None else reduce
        self.groups = batch.group_batches()  # each KV group's view of the batch (none: one group)

    def use_group(self, g: int) -> None:
        """KV group g's slots and tables (a batch of one table for every layer: that one)."""
        if self.groups:
            self.batch = self.groups[g]

    def add_norm(self, p, delta, h, norm):
        if delta is not None:
            h.add_(delta)  # residual + output: the same sum as transformers' residual + hidden_states
        return norm(h)

    def norm(self, p, x, norm):
        return norm(x)

    def qkv(self, p, x):
        c, t = self.c, x.shape[0]
        q, k, v = p.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        return q.reshape(t, c.num_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim), v.reshape(t, c.num_kv_heads, c.head_dim)

    def qk_norm(self, p, qkv):
        q, k, v = qkv
        return p.q_norm(q), p.k_norm(k), v

    def rope_write_kv(self, p, qkv, k_cache, v_cache):
        q, k, v = qkv
        q, k = p.rope(self.batch.positions, q, k)
        paged.write_kv(k_cache, v_cache, k, v, self.batch.slot_mapping)
        return q

    def attention(self, p, q, k_cache, v_cache):
        b = self.batch
        out = paged.paged_attention(
            q, k_cache, v_cache, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
            max_query_len=b.max_query_len, scale=self.c.attention_scale, backend=self.backend, window=p.window, softcap=p.softcap)
        return out.reshape(q.shape[0], -1)

    def o(self, p, attn):
        return p.o(attn)

    def gate_up(self, p, x):
        return p.gate_up(x)

    def act_mul(self, p, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return p.act(gate) * up

    def down(self, p, a):
        return p.down(a)

    def moe(self, p, x):
        return p.moe(x)

    def final_norm(self, delta, h, rows, norm):
        h.add_(delta)
        return norm(h[rows])


def _same(x):
    return x
