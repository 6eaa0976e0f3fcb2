"""Model and engine configuration: plain dataclasses, validated when constructed.

Lifecycle: a `ModelConfig` is built once by the weight loader (from config.json or GGUF
metadata) and then only read (its per-layer sliding windows as transformers reads them:
`hf_layer_windows`; the Phi-3 variants it does not implement are refused while it is built:
`check_phi3`; Gemma 2 / 3's fields and refusals: `gemma_fields`; Mixtral's, Qwen3-MoE's and Qwen2-MoE's
experts: `moe_fields`); an `EngineConfig` and a `WorkerConfig` are built from CLI flags (each field a
flag sets declares it: common/flags.py) or by tests. Nothing here reads
environment variables, and nothing imports torch until a method needs it, so the command line
builds its flags from these classes without loading the engine.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

from pdserve.common.errors import NotSupportedError, UnsupportedModelError
from pdserve.common.flags import COMPUTED, flag, insecure_flag, keys_flag
from pdserve.runtime.kv_groups import KVGroups, kv_groups
from pdserve_client.errors import InvalidRequestError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")  # mixture-of-experts families (moe_fields)
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation: SiLU (SwiGLU), or GELU's tanh form (Gemma's GeGLU)
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")  # runtime.rope computes each as transformers does


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, read as transformers' modeling_rope_utils reads it; `kind` is one of
    ROPE_TYPES. llama3: low / high_freq_factor over original_max_position. yarn: the correction
    range's rotations beta_fast / beta_slow (32 / 1 where absent or 0), its ends rounded outwards
    unless truncate is false, and cos / sin scaled by attention_factor, or where that is None by
    transformers' rule from factor, mscale and mscale_all_dim (0: absent). dynamic (NTK): its base
    grows only past the model's max_position_embeddings, which the engine never serves
    (runtime.engine caps the context there), so within it the rope is the default one."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope scaling type {self.kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if not self.factor > 0:
            raise UnsupportedModelError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.original_max_position < 1 or (self.attention_factor is not None and self.attention_factor <= 0):
            raise UnsupportedModelError(f"rope scaling original_max_position_embeddings must be >= 1 and attention_factor > 0, "
                                        f"got {self.original_max_position} and {self.attention_factor}")

    @classmethod
    def from_hf(cls, d: dict | None, max_position: int | None = None, original: int | None = None) -> RopeScaling:
        """A config.json's rope_parameters / rope_scaling dict. llama3 and yarn take their
        original_max_position_embeddings from `original` (a top-level config key, which
        transformers prefers, as Phi-3 writes it), else from the dict, else max_position (the
        model's max_position_embeddings); yarn without a factor takes max_position / that."""
        if not d:
            return cls()
        kind = d.get("rope_type", d.get("type", "default"))
        orig = original or d.get("original_max_position_embeddings") or (max_position if kind in ("llama3", "yarn") else None) or 8192
        factor = d.get("factor")
        if factor is None:
            factor = max_position / orig if kind == "yarn" and max_position else 1.0
        attention = d.get("attention_factor")
        return cls(
            kind=kind,
            factor=float(factor),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position=int(orig),
            beta_fast=float(d.get("beta_fast") or 32),
            beta_slow=float(d.get("beta_slow") or 1),
            truncate=bool(d.get("truncate", True)),
            attention_factor=None if attention is None else float(attention),
            mscale=float(d.get("mscale") or 0.0),
            mscale_all_dim=float(d.get("mscale_all_dim") or 0.0),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding-window attention, per layer: () = every layer full; else one entry per layer, 0 for
    # full attention, w for a window of w keys (a query at position p sees keys p - w < k <= p,
    # transformers' masking_utils.sliding_window_overlay)
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm of q and k (self_attn.q_norm / k_norm) before RoPE
    # Gemma 2 / 3 (all off for the other families). Gemma's RMSNorm scales by (1 + weight): the
    # loaders hand over its norm weights with the 1 added (runtime.weights; llama.cpp's converter
    # stores them so), so every path multiplies by the stored weight as Llama's RMSNorm does, in
    # float32, then casts (`norm_plus_one`: those weights stay float32 in any model dtype)
    norm_plus_one: bool = False
    sandwich_norms: bool = False  # post_attention_layernorm on the attention's output, pre-/post_feedforward_layernorm around the MLP
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden), rounded to the model dtype)
    query_pre_attn_scalar: float = 0.0  # attention scale query_pre_attn_scalar ** -0.5 (0: head_dim ** -0.5)
    attn_softcap: float = 0.0  # attention scores s -> cap * tanh(s / cap) before the softmax (0: none)
    final_softcap: float = 0.0  # logits likewise (0: none)
    activation: str = "silu"  # ACTIVATIONS
    rope_local_theta: float = 0.0  # Gemma 3: the RoPE base of the sliding-window layers, unscaled (0: rope_theta, as the others)
    # mixture-of-experts (Mixtral, Qwen3-MoE, Qwen2-MoE; runtime.moe): num_experts 0 = every layer dense.
    # A MoE layer's router picks experts_per_tok of num_experts per token (softmax in float32, then
    # torch.topk; norm_topk_prob: the chosen weights renormalised to sum 1, which is Mixtral's softmax
    # over the top-k logits); each expert is a SwiGLU MLP of width moe_intermediate_size; Qwen2-MoE
    # adds a shared expert (width shared_expert_intermediate_size) scaled by sigmoid(its gate). The
    # layers in dense_layers (Qwen's mlp_only_layers / decoder_sparse_step) keep the dense MLP
    # (intermediate_size)
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if min(self.attn_softcap, self.final_softcap, self.query_pre_attn_scalar, self.rope_local_theta) < 0 or self.embed_scale <= 0:
            raise UnsupportedModelError("soft-caps, query_pre_attn_scalar and rope_local_theta must be >= 0 and embed_scale > 0")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise UnsupportedModelError(f"layer_windows must give one window >= 0 per layer ({self.num_layers}), got {self.layer_windows}")
        if self.num_experts and not (1 <= self.experts_per_tok <= self.num_experts and self.moe_intermediate_size >= 1):
            raise UnsupportedModelError(f"mixture of experts: experts_per_tok must be in 1..num_experts ({self.num_experts}) and "
                                        f"moe_intermediate_size >= 1, got {self.experts_per_tok} and {self.moe_intermediate_size}")
        if self.shared_expert_intermediate_size < 0 or any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise UnsupportedModelError("shared_expert_intermediate_size must be >= 0 and dense_layers name layers of the model")

    def moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else the dense MLP)."""
        return bool(self.num_experts) and layer not in self.dense_layers

    @property
    def router_weights_float(self) -> bool:
        """Whether the routing weights multiply the experts' outputs in float32 (Mixtral, as
        transformers') or are first cast to the model dtype (Qwen2 / Qwen3-MoE); equal in float32."""
        return self.architecture == "MixtralForCausalLM"

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in keys, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by the local table (Gemma 3's sliding layers: base
        rope_local_theta, unscaled) instead of the global one (rope_theta, rope_scaling)."""
        return bool(self.rope_local_theta and self.window(layer))

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (and its soft-cap)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(self.layer_windows)

    @property
    def kv_window(self) -> int:
        """The window in keys past which no layer reads a sequence's KV again: every layer slides
        (the widest window when they differ); 0 when any layer attends in full (Gemma 2 / 3,
        Qwen2's layer_types), whose sliding layers free their blocks through their own KV groups'
        tables instead (`kv_groups`; runtime.kv_cache: what the block manager may free as a
        sequence grows)."""
        return max(self.layer_windows) if self.layer_windows and min(self.layer_windows) > 0 else 0

    @functools.cached_property
    def kv_groups(self) -> KVGroups:
        """How the layers share the KV pool (runtime.kv_groups): one group of every layer unless
        full-attention and sliding layers (or different windows) mix, then one block table per group."""
        windows = self.layer_windows if self.layer_windows and min(self.layer_windows) == 0 else ()
        return kv_groups(windows if len(set(windows)) > 1 else (), self.num_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type"), str(d.get("model_type")))]
        arch = archs[0]
        heads = int(d["num_attention_heads"])
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and d.get("attention_bias"):
            raise UnsupportedModelError(f"{arch} with attention_bias (q/k/v and o biases) is not supported")
        if arch == "Phi3ForCausalLM":
            check_phi3(d, rope)
        gemma = gemma_fields(arch, d) if arch in GEMMA else {}
        moe = moe_fields(arch, d) if arch in MOE else {}
        if arch == "Gemma3ForCausalLM":  # the global layers' rope (and scaling) as the others' rope
            rope, theta = gemma.pop("global_rope"), gemma.pop("global_theta")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or (256 if arch in GEMMA else d["hidden_size"] // heads)),  # Gemma's default: 256
            max_position=int(d.get("max_position_embeddings", 2048)),
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
                                             int(d.get("max_position_embeddings", 2048)),
                                             None if arch in GEMMA else d.get("original_max_position_embeddings")),
            attention_bias=bool(d.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM" else d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA)),  # Gemma ties by default
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=hf_layer_windows(arch, d),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            **gemma,
            **moe,
        )


def moe_fields(arch: str, d: dict) -> dict:
    """The mixture-of-experts fields of a Mixtral / Qwen3-MoE / Qwen2-MoE config.json, with
    transformers' defaults where a key is absent. Mixtral: num_local_experts (8) SwiGLU experts of
    width intermediate_size, top num_experts_per_tok (2), its softmax over the top-k logits (the
    softmax over all, renormalised: norm_topk_prob). Qwen3-MoE / Qwen2-MoE: num_experts (128 / 60;
    transformers 5 writes Qwen3-MoE's as num_local_experts), top num_experts_per_tok (8 / 4),
    width moe_intermediate_size, norm_topk_prob (default false), Qwen2-MoE's shared expert; the
    layers that mlp_only_layers names or decoder_sparse_step skips keep the dense MLP, as
    transformers' decoder layer decides. Refused: an activation other than SiLU."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch} hidden_act {act!r} is not supported (silu only)")
    layers = int(d["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        experts = int(d.get("num_local_experts", d.get("num_experts", 8)))
        return dict(num_experts=experts, experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True)
    qwen3 = arch == "Qwen3MoeForCausalLM"
    experts = int(d.get("num_experts", d.get("num_local_experts", 128 if qwen3 else 60)))
    step = int(d.get("decoder_sparse_step", 1) or 1)
    only = set(int(i) for i in d.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if not experts:
        return {}
    return dict(num_experts=experts, experts_per_tok=int(d.get("num_experts_per_tok", 8 if qwen3 else 4)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", 768 if qwen3 else 1408)),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), dense_layers=dense,
                shared_expert_intermediate_size=0 if qwen3 else int(d.get("shared_expert_intermediate_size", 5632)))


def gemma_fields(arch: str, d: dict) -> dict:
    """The ModelConfig fields a Gemma 2 / Gemma 3 text config.json sets, with transformers'
    defaults where a key is absent (Gemma 2 soft-caps 50 / 30, Gemma 3 none; query_pre_attn_scalar
    256); refused: bidirectional attention, attention biases, an activation other than
    gelu_pytorch_tanh, a rope scaling on Gemma 3's sliding layers. Gemma 3's RoPE comes back as
    `global_rope` / `global_theta` (its full layers') besides `rope_local_theta` (its sliding
    layers': transformers 5's rope_parameters per layer type, or older configs' rope_theta,
    rope_scaling and rope_local_base_freq)."""
    g2 = arch == "Gemma2ForCausalLM"
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch} with use_bidirectional_attention is not supported (causal attention only)")
    if d.get("attention_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias (q/k/v/o biases) is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{arch} hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")

    def cap(key: str, default: float | None) -> float:
        v = d.get(key, default)
        return float(v) if v else 0.0

    out = dict(norm_plus_one=True, sandwich_norms=True, embed_scale=float(d["hidden_size"]) ** 0.5, activation="gelu_tanh",
               query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
               attn_softcap=cap("attn_logit_softcapping", 50.0 if g2 else None),
               final_softcap=cap("final_logit_softcapping", 30.0 if g2 else None))
    if not g2:
        params = d.get("rope_parameters") or {}
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
        if not params and d.get("rope_scaling"):
            full.update(d["rope_scaling"])
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise UnsupportedModelError(f"Gemma 3 rope scaling {local.get('rope_type', local.get('type'))!r} on the sliding layers "
                                        "is not supported (their rope is unscaled in every published Gemma 3)")
        out["rope_local_theta"] = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        out["global_theta"] = float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
        out["global_rope"] = full
    return out


def check_phi3(d: dict, rope: dict) -> None:
    """Refuse the Phi-3 configs this runtime would serve wrong: rope scaling other than the
    default (the 128k variants' "longrope", called "su" or "yarn" in older configs: per-frequency
    short / long factors), a partial rotary factor below 1 (RoPE on part of each head) and an
    activation other than SiLU. Phi-3-mini/medium 4k (default rope, full rotary) pass."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UnsupportedModelError(f"Phi-3 rope scaling {kind!r} (the 128k variants' longrope) is not supported; "
                                    "only the default rope (Phi-3 4k variants) is")
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"Phi-3 partial_rotary_factor {partial} is not supported (RoPE on every head dimension only)")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Phi-3 hidden_act {d.get('hidden_act')!r} is not supported (silu only)")


def hf_layer_windows(arch: str, d: dict) -> tuple[int, ...]:
    """Each layer's sliding window (0: full) as transformers reads a config.json: Mistral and
    Phi-3 slide every layer when `sliding_window` is set (no `use_sliding_window` key:
    Mistral-7B-v0.1 has 4096, Phi-3-mini-4k 2047); Qwen2 / Qwen3 only with `use_sliding_window`,
    on the layers `layer_types` marks "sliding_attention" (default: those from
    `max_window_layers` on); Llama never."""
    layers, window = int(d["num_hidden_layers"]), d.get("sliding_window")
    if arch in GEMMA:  # sliding layers from layer_types (default: every 2nd / 6th layer full, as transformers)
        window = d.get("sliding_window", 4096)
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(d.get("sliding_window_pattern", 6))
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if "sliding_attention" in types and not window:
            raise UnsupportedModelError(f"{arch}: sliding_attention layers without a sliding_window")
        return _windows_of(types, layers, int(window or 0))
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return (int(window),) * layers if window else ()
    if arch == "Qwen3MoeForCausalLM":  # every layer, with use_sliding_window (transformers' Qwen3MoeAttention)
        return (int(window),) * layers if window and d.get("use_sliding_window", False) else ()
    if arch == "Qwen2MoeForCausalLM":  # layer_types, else its own default: odd-numbered (1-based) layers below max_window_layers
        if not (window and d.get("use_sliding_window", False)):
            return ()
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < int(d.get("max_window_layers", 28)) else "full_attention"
                                         for i in range(layers)]
        return _windows_of(types, layers, int(window))
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not (window and d.get("use_sliding_window", False)):
        return ()
    types = d.get("layer_types") or ["sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
                                     for i in range(layers)]
    return _windows_of(types, layers, int(window))


def _windows_of(types: list, layers: int, window: int) -> tuple[int, ...]:
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != layers:
        raise UnsupportedModelError(f"layer_types {sorted(unknown) or types} not supported (full_attention / sliding_attention per layer)")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


# kernels.cpu_native.ACTIVATION_MODES and kernels.backends.BY_NAME, named here so that --help imports no torch
# (tests/serving/test_engine_flags.py checks they agree)
QUANT_ACTIVATIONS = ("float", "int16", "int8")  # how a small decode batch meets quantized weights
LINEAR_BACKENDS = ("auto", "auto-reduced", "rules", "c", "onednn", "mkl", "onednn-bf16", "int8pack",  # --linear-backend
                   "c-float", "c-int16", "c-int8", "c-int8-vnni", "dequant-mkl", "int4pack")  # (runtime.linear_plan)
KV_BACKENDS = ("auto", "shm", "tcp", "cuda_ipc", "nccl")  # --kv-backend (kvtransfer)
AUTO_KV_CACHE_MB = 2048  # the workers' KV budget unless --kv-cache-mb is given (vLLM's CPU peer here runs with 2 GiB)


def auto_kv_cache_mb(shm_dir: str | None = None) -> int:
    """A worker's default KV pool budget in MiB: AUTO_KV_CACHE_MB, or less on a small machine: at
    most a quarter of the memory available now and half of the free space of /dev/shm (where the
    shared pools of disaggregated workers live). 512 MiB, the old fixed default, held 11,650
    tokens of the default model: 64 sequences of 128 + 128 tokens did not fit and were preempted
    and recomputed (the 64-request burst ran at 0.86x vLLM's throughput)."""
    budget = AUTO_KV_CACHE_MB
    try:
        with open("/proc/meminfo") as f:
            available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        budget = min(budget, available_kb // 1024 // 4)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        from pdserve.common.shm import shm_dir as pools_dir

        st = os.statvfs(shm_dir or pools_dir())
        budget = min(budget, st.f_bavail * st.f_frsize // 2**20 // 2)
    except OSError:
        pass
    return max(16, budget)


@dataclass
class EngineConfig:
    """How one process runs the model: dtype, KV pool size, batching limits."""

    dtype: str = flag("auto", group="model and weights", choices=("auto", *DTYPES), launch=True,
                      help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    block_size: int = flag(16, group="KV cache and transfer", launch=True, help="tokens per KV block (a power of two)")
    num_blocks: int | None = flag(None, group="KV cache and transfer", help="KV pool size in blocks (overrides --kv-cache-mb)")
    # in-process default; the worker commands size it with auto_kv_cache_mb()
    kv_cache_bytes: int = flag(512 * 2**20, group="KV cache and transfer", name="kv_cache_mb", scale=2**20, command_default=COMPUTED,
                               launch=True, help=f"KV pool memory budget per worker, MiB (per GPU for a tensor-parallel worker on CUDA: "
                               f"each rank's pool of its KV heads; default: {AUTO_KV_CACHE_MB}, or less on a small "
                               "machine: at most a quarter of the available memory and half of /dev/shm's free space)")
    kv_cache_dtype: str = flag("auto", group="KV cache and transfer", choices=("auto", "int8", "fp8", "fp8_e4m3"), launch=True,
                               help="KV cache storage (vLLM's names): auto (the model dtype), int8 or fp8 (e4m3), each row of a "
                               "token's head with its own float32 scale (CPU only; prefill and decode workers must agree)")
    max_num_seqs: int = flag(64, group="scheduling", launch=True, help="sequences one worker runs at once")
    max_num_batched_tokens: int = flag(2048, group="scheduling", aliases=("--max-batched-tokens",), launch=True,
                                       help="token budget of one step")
    attention_backend: str = "auto"
    device: str = flag("cpu", group="model and weights", launch=True, help="cpu, cuda or cuda:N")
    max_model_len: int | None = flag(None, group="scheduling", launch=True, help="context length, prompt + output (default: the model's)")
    cuda_graphs: bool = True  # on a CUDA device the decode worker replays captured decode steps (runtime.cuda_graphs)
    # float32 on the CPU: the fused forward of runtime.cpu_forward (off: the module forward, its twin)
    fast_path: bool = True
    linear_kind: str = "auto"  # kernels.linear: auto, torch (F.linear) or onednn (prepacked)
    # runtime.linear_plan: rules (kernels.linear's fixed rules) in process; the worker commands default to auto
    linear_backend: str = flag("rules", group="model and weights", choices=LINEAR_BACKENDS, command_default="auto", launch=True,
                               help="CPU: which back-end multiplies each linear layer. auto: the fastest of the float32-faithful "
                               "ones, measured per shape and row count at first start (cached); auto-reduced: bf16 / int8 ones "
                               "too where they pass a teacher-forced accuracy check; rules: fixed row-count rules; or one back-end by name")
    # auto: a GGUF's Q4_0/Q4_1/Q8_0 matrices stay quantized (kernels.quant) where the CPU fast path
    # runs; none: dequantized to float32 at load (the reference the HF-equivalence tests use)
    quantization: str = flag("auto", group="model and weights", aliases=("-q",), choices=("auto", "none"), launch=True,
                             help="auto: serve a GGUF's Q4_0/Q4_1/Q8_0 weights as they are (CPU); none: dequantize to float32")
    # quantized weights only: how activations meet them. float: every
    # product is x times the dequantized weight (the float twin up to summation order); int16
    # (the default) / int8: x is rounded per 32-wide block to integers (to 1/32767 / 1/127 of the
    # block's largest value) and multiplied in integers (int8 is what llama.cpp does). int16 is
    # 1.6x faster than float at one row and scores like it (teacher-forced over the 54 shipped
    # prompts: top-1 100%, mean KL 0.00000); int8 is faster still but misses (95.9%, 0.0100).
    # int16 also takes larger batches and prompts (kernels.quant.kernel_rows: 1.1-1.5x dequantize
    # + MKL or the float tiled kernel; prefill top-1 99.88%, KL 0.00000); with float or int8,
    # batches above 4 rows run float.
    quant_activations: str = flag("int16", group="model and weights", choices=QUANT_ACTIVATIONS, launch=True,
                                  help="quantized weights: how a small decode batch (<= 4 rows; int16: <= 7) is multiplied: float "
                                  "(exact to summation order), int16 or int8 (activations rounded per 32-wide block, K-quants at <= 4 "
                                  "rows per 256; integer products; faster, approximate)")
    gpu_memory_utilization: float | None = flag(None, group="KV cache and transfer", launch=True,
                                                help="CUDA only: size the KV pool so that this share of the GPU's memory is used "
                                                "(instead of --kv-cache-mb; per GPU: with tensor parallelism, of each rank's GPU)")
    prefix_cache: bool = flag(True, group="KV cache and transfer", name="no_prefix_cache", launch=True,
                              help="do not reuse the KV of token prefixes computed before (the prefix cache is on by default, as in vLLM)")
    kv_host_tier_bytes: int = flag(0, group="KV cache and transfer", name="kv_host_tier_mb", scale=2**20, launch=True,
                                   help="a node-wide host-memory KV tier of this many MiB per model (kvtransfer.host_tier; 0: off): "
                                   "blocks evicted from a worker's prefix cache go there, and every worker of the node loads them "
                                   "from there instead of recomputing them")
    tensor_parallel_size: int = flag(1, group="parallelism", aliases=("-tp",), min=1, launch=True,
                                     help="rank processes a worker splits the model over (runtime.tp; CPU: gloo on loopback; CUDA: NCCL, "
                                     "one GPU per rank from --device's on); "
                                     "`pdserve launch` also takes --prefill-tp / --decode-tp per side")
    pipeline_parallel_size: int = flag(1, group="parallelism", aliases=("-pp",), min=1, launch=True,
                                       help="only 1: pipeline parallelism is not supported")

    def __post_init__(self):
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8", "fp8_e4m3"):
            raise InvalidRequestError(f"kv_cache_dtype must be auto, int8, fp8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and not self.device.startswith("cpu"):
            raise NotSupportedError(f"--kv-cache-dtype {self.kv_cache_dtype} is not supported on {self.device}: the Triton paged "
                                    "attention kernels do not read a quantized KV cache (the CPU kernels do)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.linear_kind not in ("auto", "torch", "onednn"):
            raise InvalidRequestError(f"linear_kind must be auto, torch or onednn, got {self.linear_kind!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise InvalidRequestError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise InvalidRequestError(f"quant_activations must be one of {', '.join(QUANT_ACTIVATIONS)}, got {self.quant_activations!r}")
        if self.quantization not in ("auto", "none"):
            raise InvalidRequestError(f"quantization must be auto or none, got {self.quantization!r}")
        if self.kv_host_tier_bytes < 0:
            raise InvalidRequestError(f"kv_host_tier_mb must be >= 0, got {self.kv_host_tier_bytes / 2**20:g}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self._check_parallel()
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if not self.device.startswith("cuda"):
                raise InvalidRequestError(f"gpu_memory_utilization needs a CUDA device (this one is {self.device!r}); size the KV pool with kv_cache_mb")

    def _check_parallel(self) -> None:
        if self.pipeline_parallel_size != 1:
            raise NotSupportedError(f"pipeline parallelism is not supported (--pipeline-parallel-size {self.pipeline_parallel_size}); "
                                    "use --tensor-parallel-size")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and not self.device.startswith(("cpu", "cuda")):
            raise NotSupportedError(f"tensor parallelism on {self.device} is not supported (cpu: gloo, cuda: NCCL)")

    @property
    def keep_quantized(self) -> bool:
        """Whether to load a GGUF's quantized matrices as blocks (runtime.weights keep_quantized)."""
        return self.quantization == "auto"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self):
        """The KV pool's storage dtype: the model's (auto), or int8 / float8_e4m3fn (kernels.kv_quant)."""
        from pdserve.kernels import kv_quant

        return kv_quant.storage_dtype(self.kv_cache_dtype, self.torch_dtype)

    def kv_bytes_per_token(self, model: ModelConfig) -> int:
        """KV bytes one token holds in this pool: every layer, K and V, every KV head (scales included)."""
        from pdserve.kernels import kv_quant

        return kv_quant.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, self.kv_torch_dtype)

    def blocks_for_budget(self, model: ModelConfig) -> int:
        """Number of KV blocks (all layers, K and V) one KV pool holding `model`'s KV heads gets:
        num_blocks, or what kv_cache_bytes buys, or with gpu_memory_utilization what the device
        has left (call it once the weights are there). The budget is per pool: a TP 1 worker's; a
        CPU tensor-parallel worker's one pool of every head, which its ranks share (the budget is
        the worker's); on CUDA each rank's pool of its KV heads on its GPU (pass
        runtime.tp.rank_config; the budget is per GPU, as vLLM's gpu_memory_utilization)."""
        if self.num_blocks is not None:
            return self.num_blocks
        from pdserve.kernels import kv_quant

        # a block id holds one KV group's layers (runtime.kv_groups: every layer unless windows mix)
        per_block = self.block_size * kv_quant.bytes_per_token(model.kv_groups.size, model.num_kv_heads, model.head_dim, self.kv_torch_dtype)
        budget = self.kv_cache_bytes if self.gpu_memory_utilization is None else self.gpu_kv_budget()
        return max(1, math.floor(budget / per_block))

    def gpu_kv_budget(self) -> int:
        """Bytes left for the KV pool, called once the weights are on the GPU: the device's total
        memory x gpu_memory_utilization, less what is in use now (by this process and any other),
        less a 5% reserve for activations."""
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        budget = int(total * (self.gpu_memory_utilization - 0.05)) - (total - free)
        if budget <= 0:
            raise InvalidRequestError(
                f"gpu_memory_utilization {self.gpu_memory_utilization} leaves no room for the KV cache: "
                f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is already in use")
        return budget

    def summary(self, max_model_len: int, num_blocks: int, pool_bytes: int) -> dict:
        """The settings a worker runs with, for the coordinator's stats (vLLM's flag names);
        kv_pool_mb is the pool it allocated (kv_cache_mb is the budget it was given)."""
        return {
            "dtype": self.dtype, "device": self.device, "max_model_len": max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "block_size": self.block_size, "num_blocks": num_blocks,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_cache_mb": round(self.kv_cache_bytes / 2**20, 3), "kv_pool_mb": round(pool_bytes / 2**20, 3),
            "gpu_memory_utilization": self.gpu_memory_utilization, "quantization": self.quantization,
            "quant_activations": self.quant_activations, "prefix_cache": int(self.prefix_cache),
            "tensor_parallel_size": self.tensor_parallel_size, "linear_backend": self.linear_backend,
            "kv_host_tier_mb": round(self.kv_host_tier_bytes / 2**20, 3),
        }


@dataclass
class WorkerConfig:
    """What a worker process needs beyond the engine: where the coordinator is, who it is."""

    coordinator: str = flag("tcp://127.0.0.1:5556", group="network", help="coordinator worker port")
    model: str | None = flag(None, group="model and weights", launch=True, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    worker_id: str = flag("", group="network", help="default: ROLE-PID")
    # prefill: auto (from each decode pool's description), or force one
    kv_backend: str = flag("auto", group="KV cache and transfer", choices=KV_BACKENDS, launch=True,
                           help="how to hand KV to decode workers (auto: from each decode pool's description)")
    kv_bind: str = flag("tcp://127.0.0.1:*", group="KV cache and transfer", help="where prefill workers deliver KV")  # decode
    shared_pool: bool = True  # decode: put the KV pool in /dev/shm for the shm backend
    handoff_stream: bool = flag(True, group="KV cache and transfer", pair=True,  # prefill: worker/handoff.py
                                help="send each chunk's finished KV blocks to the decode worker as soon as the chunk is computed, "
                                "not all after the prompt's last chunk (`pdserve launch --engine-arg=--no-handoff-stream`)")
    batch_window_ms: float = flag(2.0, group="scheduling", help="wait this long to pack more prompts into a forward")  # prefill
    heartbeat_s: float = flag(0.5, group="network", help="seconds between heartbeats (load, free KV blocks, step times); keep well "
                              "under the coordinator's --worker-timeout")
    grant_timeout_s: float = 30.0  # decode: a grant whose KV never arrives is freed after this
    threads: int | None = flag(None, group="parallelism", help="torch threads (default: torch's choice; with TP n, each rank a 1/n share)")
    core_share: str | None = flag(None, group="parallelism",  # runtime.cores
                                  help="PATH:SLOT from the launcher: share the node's cores with its other busy workers")
    keys: str | None = keys_flag()
    insecure: bool = insecure_flag()  # allow a non-loopback kv bind without keys

    def __post_init__(self):
        if self.kv_backend not in KV_BACKENDS:
            raise InvalidRequestError(f"kv_backend must be auto, shm, tcp, cuda_ipc or nccl, got {self.kv_backend!r}")
        if self.batch_window_ms < 0 or self.heartbeat_s <= 0 or self.grant_timeout_s <= 0:
            raise InvalidRequestError("batch_window_ms must be >= 0, heartbeat_s and grant_timeout_s > 0")
