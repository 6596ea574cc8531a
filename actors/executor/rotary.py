"""Rotary position tables: the frequencies a model's config asks for, scaling included.

Each scaling type is computed with transformers' own float32 expressions (its
`modeling_rope_utils`), so a float32 model's rotary matches it exactly. Reading a scaling
out of a config file is the loader's work; applying the tables is the model's.

The tables cover the positions a worker serves (its max model length), not every position the
model was trained for: Gemma 3's two bases over its 131,072 positions (head size 256) take
512 MiB in float32, over a 4096-token worker's 16 MiB.

Phi-3's longrope picks its short or long factors by sequence length. transformers decides per
forward by the longest position in it, and when a generation grows past the original context
it drops its cache and encodes the whole sequence again with the long factors: every token of a
sequence longer than the original context is computed with the long ones. A paged pool cannot
re-encode a sequence's cached pages when it crosses, so the choice here is made once, by the
longest sequence the tables serve: the long factors when that is past the original context,
the short ones otherwise (as llama.cpp decides it by its context size). A sequence longer than
the original context then runs exactly as in transformers; a shorter one does only where the
worker serves no more than the original context.
"""

from __future__ import annotations

import math

import torch

from sluice.actors.executor.config import ROPE_SCALING_TYPES, RopeScaling

__all__ = ["ROPE_SCALING_TYPES", "RopeScaling", "inverse_frequencies", "rotary_tables",
           "table_bytes"]


def rotary_tables(head_dim: int, rope_theta: float, max_positions: int,
                  scaling: RopeScaling | None, device,
                  rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [rows, head_dim], float32 whatever the model dtype: rotary is computed
    in float32. `max_positions` is the model's max_position_embeddings; `rows` the positions
    served (all of max_positions when None), which also picks longrope's factors."""
    rows = max_positions if rows is None else rows
    if rows < 1:
        raise ValueError(f"rotary tables need at least one position, got {rows}")
    inv_freq, attention_factor = inverse_frequencies(head_dim, rope_theta, max_positions, scaling,
                                                     longest=rows)
    positions = torch.arange(rows, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:  # yarn and longrope scale q and k both, so scores by its square
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device), sin.to(device)


def table_bytes(head_dim: int, rows: int) -> int:
    """Bytes of one (cos, sin) pair of `rows` positions."""
    return 2 * rows * head_dim * torch.float32.itemsize


def inverse_frequencies(dim: int, base: float, max_positions: int,
                        scaling: RopeScaling | None,
                        longest: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotary pair, factor on cos and sin) for sequences of up to
    `longest` positions (max_positions when None)."""
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
    if kind == "longrope":
        return _longrope(dim, base, exponents, scaling,
                         max_positions if longest is None else longest)
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


def _longrope(dim: int, base: float, exponents: torch.Tensor, s: RopeScaling,
              longest: int) -> tuple[torch.Tensor, float]:
    """Each frequency divided by its short factor, or by its long one where sequences may be
    longer than the original context; cos and sin scaled by sqrt(1 + ln(factor) / ln(original))
    unless the config gives the attention factor."""
    original = s.original_max_position_embeddings
    factors = s.long_factor if longest > original else s.short_factor
    if len(factors) != dim // 2:
        which = "long_factor" if longest > original else "short_factor"
        raise ValueError(f"longrope {which}: {len(factors)} given, {dim // 2} rotary "
                         f"frequencies (head_dim {dim})")
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if s.factor <= 1.0
                            else math.sqrt(1 + math.log(s.factor) / math.log(original)))
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext_factors * base ** exponents), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
