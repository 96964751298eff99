"""Zero-pad the experts' I to a backend's `intermediate_multiple` (CUTLASS 16, trtllm-gen 128),
gate and up apart (one block would shift up into gate's rows); exact, as act(0) * 0 = 0."""
from __future__ import annotations

import torch

from ..weights import ExpertWeights


def padded_size(size: int, multiple: int) -> int:
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-size // multiple) * multiple


def pad_experts(w13: torch.Tensor, w2: torch.Tensor, multiple: int,
                gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    I = w2.shape[2]
    rows = 2 * I if gated else I
    if w13.shape[0] != w2.shape[0] or w13.shape[1] != rows:
        raise ValueError(f"w13 {tuple(w13.shape)} does not match w2 {tuple(w2.shape)}: "
                         f"expected (E, {rows}, H) for {'gated' if gated else 'non-gated'} "
                         f"experts with I={I}")
    padded = pad_expert_weights(ExpertWeights(w13, w2, gated), multiple)
    return padded.w13, padded.w2  # [E, 2I', H], [E, H, I']


def pad_expert_weights(weights: ExpertWeights, multiple: int) -> ExpertWeights:
    return weights.pad_intermediate(multiple)
