"""Rotary position embedding: inverse frequencies (default, linear, llama3 scaling) and a
cos/sin table built once per model, indexed by absolute position at every step.

The arithmetic follows transformers' Llama exactly (float32 inv_freq, positions * inv_freq,
cat(freqs, freqs), rotate_half) so greedy outputs match token for token.
"""
from __future__ import annotations

import math

import torch

from pdserve.runtime.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: (T, H, D), k: (T, KVH, D), positions: (T,)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
