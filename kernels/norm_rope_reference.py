"""Pure-torch twins of the fused RMSNorm and rotary-embedding kernels (`norm_rope.py`).

Same signatures as the Triton launchers and the same arithmetic as the Llama model: the norm
in float32, cast back to the input dtype before the weight; rotary in the "rotate half"
layout with cos/sin tables of shape [max_positions, head_dim]. Nothing here imports triton.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, hidden] normalised by its root mean square, times weight [hidden]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next layer's input."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [num_tokens, heads, head_dim] and key [num_tokens, kv_heads, head_dim] rotated
    by the angle of each token's position; returns new tensors."""
    cos_rows = cos[positions].unsqueeze(1)
    sin_rows = sin[positions].unsqueeze(1)
    return _rotate(query, cos_rows, sin_rows), _rotate(key, cos_rows, sin_rows)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
