"""Rotary position embeddings, including Llama 3's frequency-dependent `rope_scaling`.

`rope_scaling` is Hugging Face's dict (`rope_type` default, linear or llama3), or
{"rope_type": "frequency_factors", "factors": [...]}: one divisor per inverse frequency, which is how
a GGUF file carries Llama 3 scaling (llama.cpp's converter writes the factors as a `rope_freqs`
tensor instead of the settings they come from).
"""
from __future__ import annotations

import math

import torch


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "frequency_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly, so the model keeps local precision while reaching longer contexts.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


class RotaryTable:
    """Precomputed cos/sin for every position up to max_positions (non-interleaved halves, as HF)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device, dtype: torch.dtype):
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [T], shaped [T, 1, head_dim]: looked up once per forward pass
        and shared by every layer's q and k."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos/sin from lookup()."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
