"""The pure-torch reference of the whole expert layer, in float32: the ground truth of every test.

It shares no code with the Triton path but `activation_torch` (itself a plain torch function):
a per-expert loop, as transformers' eager experts compute it.
"""
from __future__ import annotations

import torch

from .activation import SILU_AND_MUL, Activation, activation_torch


def fused_experts_torch(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gated, [E, I, H] non-gated
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]; ids outside [0, E) are filtered and add nothing
    topk_weights: torch.Tensor,  # [T, K]
    *,
    activation: Activation = SILU_AND_MUL,
) -> torch.Tensor:
    """Float32 result, shape (T, H); cast it to compare with a low-precision output."""
    x = hidden_states.float()
    out = torch.zeros_like(x)  # [T, H]
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = activation_torch(x[tokens] @ w13[e].float().T, activation)  # [n, I]
        y = h @ w2[e].float().T  # [n, H]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out
