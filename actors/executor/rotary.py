"""Rotary position tables: the frequencies a model's config asks for, scaling included.

Each scaling type is computed with transformers' own float32 expressions (its
`modeling_rope_utils`), so a float32 model's rotary matches it exactly. Reading a scaling
out of a config file is the loader's work; applying the tables is the model's.
"""

from __future__ import annotations

import math

import torch

from sluice.actors.executor.config import ROPE_SCALING_TYPES, RopeScaling

__all__ = ["ROPE_SCALING_TYPES", "RopeScaling", "inverse_frequencies", "rotary_tables"]

def rotary_tables(head_dim: int, rope_theta: float, max_positions: int,
                  scaling: RopeScaling | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim], float32 whatever the model dtype: rotary
    is computed in float32."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, rope_theta, max_positions, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:  # yarn scales q and k both, so scores by its square
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device), sin.to(device)


def inverse_frequencies(dim: int, base: float, max_positions: int,
                        scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotary pair, factor on cos and sin)."""
    kind = scaling.rope_type if scaling else "default"
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "dynamic":
        # transformers' NTK base at a sequence as long as the table: the unscaled base up to
        # rounding, kept to its expression so the table stays bit-equal
        length = max_positions
        base = base * ((scaling.factor * length / length) - (scaling.factor - 1)) ** (
            dim / (dim - 2))
    if kind == "yarn":
        return _yarn(dim, base, exponents, scaling)
    inv_freq = 1.0 / (base ** exponents)
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "frequency_divisors":
        divisors = torch.tensor(scaling.frequency_divisors, dtype=torch.float32)
        if divisors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency divisors: {divisors.numel()} given, "
                             f"{inv_freq.numel()} rotary frequencies (head_dim {dim})")
        return inv_freq / divisors, 1.0
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths shorter than original/high_freq_factor kept, longer than
    original/low_freq_factor divided by `factor`, those between blended smoothly."""
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, exponents: torch.Tensor,
          s: RopeScaling) -> tuple[torch.Tensor, float]:
    """Interpolated (divided by `factor`) and extrapolated (unscaled) frequencies blended by a
    linear ramp over the dimensions between the beta_fast and beta_slow rotation counts."""
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(
                s.factor, s.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_share = 1 - ramp
    inv_freq = (interpolated * (1 - extrapolation_share)
                + extrapolated * extrapolation_share)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
