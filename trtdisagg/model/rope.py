"""Rotary position embedding, in Hugging Face's `rotate_half` convention.

The head dim is split into two halves (not interleaved pairs); frequencies are computed in float32
and cos/sin are cast to the activation dtype before use, exactly as transformers does, so float32
results agree with it to the last few ulps.
"""

from __future__ import annotations

import math

import torch

from trtdisagg.model.args import Llama3RopeScaling


def inv_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None, *, device: torch.device
) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies, with Llama 3.1 scaling applied if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # is interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [N, head_dim] for positions [N]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] by the per-token tables [N, D]."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
