"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
each expert runs once per step on the tokens routed to it, and their outputs add up weighted
by the router's probabilities.

The routing is transformers' own: softmax over all experts in float32, top-k of those
probabilities, renormalised to sum to 1 where the model says so (Mixtral always, Qwen3-MoE by
`norm_topk_prob`), cast back to the model dtype before the expert outputs are weighted. An
expert no token chose does no work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class MoEMLP:
    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 top_k: int, normalize: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor]):
        """`router` [experts, hidden]; `gate_up` [experts, 2 * intermediate, hidden] (gate
        rows then up rows); `down` [experts, hidden, intermediate]."""
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.top_k = top_k
        self.normalize = normalize
        self.activation = activation
        self.linear = F.linear  # the deterministic mode's fixed-tile matmul replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.linear(x, self.router)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = self.linear(x[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = self.linear(self.activation(gate) * up, self.down[expert])
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out
