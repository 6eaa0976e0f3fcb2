"""Rotary position embedding: inverse frequencies (default, linear, llama3, yarn, dynamic NTK
scaling) and a cos/sin table built once per model, indexed by absolute position at every step.

Lifecycle: a model builds one RotaryEmbedding per rope base at construction (runtime.model,
runtime.tp_model); its `cos` / `sin` tables are then only read, by the module forward here and by
the fused CPU step (runtime.cpu_forward, kernels.cpu_native), which take them as they are.

The arithmetic follows transformers exactly (modeling_rope_utils' `_compute_*_parameters`: float32
inv_freq, positions * inv_freq, cat(freqs, freqs), cos / sin times the rope's attention factor,
rotate_half) so greedy outputs match token for token. YaRN's attention factor is folded into the
tables as transformers folds it into cos / sin, so every path that reads them applies it.
"""
from __future__ import annotations

import math

import torch

from pdserve.runtime.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,), attention factor) as transformers' rope init function of `scaling.kind`
    returns them for a model whose max_position_embeddings is max_position."""
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if scaling.kind == "dynamic":  # _compute_dynamic_ntk_parameters at its init (seq_len = max_position): the base unchanged
        theta = theta * ((scaling.factor * max_position / max_position) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3_scale(inv_freq, scaling), 1.0
    return inv_freq, 1.0


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `scale` times longer (the paper's eq. 21)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeScaling) -> float:
    """What cos / sin are multiplied by: attention_factor as given, else from factor, mscale and
    mscale_all_dim (both set) or factor alone."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return float(yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim))
    return yarn_mscale(s.factor)


def yarn_extrapolation(s: RopeScaling, dim: int, base: float) -> torch.Tensor:
    """YaRN's frequency correction: per frequency (dim // 2,), the share kept at its original
    (extrapolated) value; the rest is interpolated (divided by factor). 1 for the frequencies that
    turn more than beta_fast times over original_max_position, 0 for those under beta_slow, a
    linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return 1 - ramp


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = yarn_extrapolation(s, dim, base)
    return interpolated * (1 - keep) + extrapolated * keep, yarn_attention_factor(s)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv_freq, attention_factor = inv_frequencies(head_dim, theta, scaling, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: (T, H, D), k: (T, KVH, D), positions: (T,)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
