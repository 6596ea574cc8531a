"""The decoder's elementwise steps fused for bf16 and fp16 models on CPU
(`csrc/fused_cpu.cpp`, built into the library of the paged attention op): the residual add
with RMSNorm, rotary over q and k, and SwiGLU's silu(gate) * up, each one pass over a row
where torch makes several.

The torch expressions in the model (`_add_rms_norm`, `_rotate`, `F.silu(gate) * up`) are
their definition, and still run float32 models (whose outputs match the reference
implementation bit for bit) and every case these do not take. Rotary and SwiGLU give torch's
bits; the norm sums a row's squares in another order, so its output may differ from torch's
by a unit in the last place of the model dtype.
"""

from __future__ import annotations

import torch

from sluice.kernels import cpu_paged

__all__ = ["available_for", "add_rms_norm", "rotate", "silu_mul"]


def available_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` runs the fused steps."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and cpu_paged.available())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [rows, hidden] and weight [hidden]
    in x's dtype."""
    x = x.contiguous()
    normed = torch.empty_like(x)
    if residual is None:
        torch.ops.sluice_cpu.add_rms_norm_into(normed, x, x, None, weight, eps)
        return normed, x
    summed = torch.empty_like(x)
    torch.ops.sluice_cpu.add_rms_norm_into(normed, summed, x, residual.contiguous(), weight,
                                           eps)
    return normed, summed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary (half-split layout) of x [rows, heads, head_dim] (whole heads side by side; rows
    may be apart) by float32 cos and sin of [rows, 1, head_dim]."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.sluice_cpu.rotary_into(out, x, cos, sin)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * intermediate] holding (gate, up) side by side."""
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    torch.ops.sluice_cpu.silu_mul_into(out, gate_up)
    return out
