"""Alignment padding: zero-pad the experts' intermediate size I up to a backend's multiple.

Kernels need the per-partition I to be a multiple of their tile (CUTLASS MoE 16, trtllm-gen 128;
the multiple is `BackendSpec.intermediate_multiple`), and real checkpoints break it: NemotronH
FP8 has moe_intermediate_size 7688, 961 per partition at tensor-parallel 8.

    gated     gate_up_proj (E, 2I, H) = [gate; up] -> [gate | 0; up | 0]  (E, 2I', H)
    non-gated up_proj      (E, I, H)               -> [up | 0]            (E, I', H)
    down_proj (E, H, I)                            -> [down | 0]          (E, H, I')

Exact: a zero gate row and a zero up row give act(0) * 0 = 0 (relu(0)^2 = 0 for non-gated),
and the zero down_proj columns multiply it anyway. Padding the concatenation [gate; up] as one
block would instead shift the up half into the gate half's rows. Scales are padded with their
weights (`ExpertWeights.pad_intermediate`).
"""
from __future__ import annotations

import torch

from ..weights import ExpertWeights


def padded_size(size: int, multiple: int) -> int:
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-size // multiple) * multiple


def pad_experts(w13: torch.Tensor, w2: torch.Tensor, multiple: int, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) with I zero-padded to a multiple of `multiple`; the same tensors when already aligned.

    w13 (E, 2I, H) [gate; up] when gated, else (E, I, H); w2 (E, H, I).
    """
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    I = w2.shape[2]
    rows = 2 * I if gated else I
    if w13.shape[0] != w2.shape[0] or w13.shape[1] != rows:
        raise ValueError(f"w13 {tuple(w13.shape)} does not match w2 {tuple(w2.shape)}: expected (E, {rows}, H) "
                         f"for {'gated' if gated else 'non-gated'} experts with I={I}")
    padded = pad_expert_weights(ExpertWeights(w13, w2, gated), multiple)
    return padded.w13, padded.w2  # [E, 2I', H], [E, H, I']


def pad_expert_weights(weights: ExpertWeights, multiple: int) -> ExpertWeights:
    """`weights` with I zero-padded to a multiple of `multiple`, scales padded to match (gate and up
    separately); the same object when already aligned."""
    return weights.pad_intermediate(multiple)
