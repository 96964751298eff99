"""Alignment padding: zero-pad the experts' intermediate size I up to a backend's multiple.

Kernels need the per-partition I to be a multiple of their tile (CUTLASS MoE 16, trtllm-gen 128;
the multiple is `BackendSpec.intermediate_multiple`), and real checkpoints break it: NemotronH
FP8 has moe_intermediate_size 7688, 961 per partition at tensor-parallel 8.

    gated     gate_up_proj (E, 2I, H) = [gate; up] -> [gate | 0; up | 0]  (E, 2I', H)
    non-gated up_proj      (E, I, H)               -> [up | 0]            (E, I', H)
    down_proj (E, H, I)                            -> [down | 0]          (E, H, I')

Exact: a zero gate row and a zero up row give act(0) * 0 = 0 (relu(0)^2 = 0 for non-gated),
and the zero down_proj columns multiply it anyway. Padding the concatenation [gate; up] as one
block would instead shift the up half into the gate half's rows. FP8 weights pad their scales
the same way (`pad_expert_weights`): new scale rows / block rows / block columns are 1, which
multiplies zeros only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
    padded = padded_size(I, multiple)
    if padded == I:
        return w13, w2
    return _pad_rows(w13, 2 if gated else 1, padded), _pad_cols(w2, padded)  # [E, 2I', H], [E, H, I']


def _pad_rows(t: torch.Tensor, halves: int, rows_per_half: int, value: float = 0.0) -> torch.Tensor:
    """t [E, halves * r, ...] -> [E, halves * rows_per_half, ...]: each half padded at its end."""
    parts = t.chunk(halves, dim=1)
    extra = rows_per_half - parts[0].shape[1]
    pad = (0, 0) * (t.dim() - 2) + (0, extra)
    if t.dtype == torch.float8_e4m3fn:  # F.pad has no float8 kernel; zero bytes are +0.0 in e4m3
        return torch.cat([F.pad(p.view(torch.uint8), pad) for p in parts], dim=1).view(t.dtype)
    return torch.cat([F.pad(p, pad, value=value) for p in parts], dim=1)


def _pad_cols(t: torch.Tensor, cols: int, value: float = 0.0) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return F.pad(t.view(torch.uint8), (0, cols - t.shape[-1])).view(t.dtype)
    return F.pad(t, (0, cols - t.shape[-1]), value=value)


def pad_expert_weights(weights: ExpertWeights, multiple: int) -> ExpertWeights:
    """`weights` with I zero-padded to a multiple of `multiple`, scales padded to match (gate and up
    separately); the same object when already aligned."""
    I = weights.intermediate_size
    padded = padded_size(I, multiple)
    if padded == I:
        return weights
    halves = 2 if weights.gated else 1
    fmt = weights.format
    w13, w2 = pad_experts(weights.w13, weights.w2, multiple, weights.gated)
    s13, s2 = weights.w13_scale, weights.w2_scale
    if fmt.block is not None:
        block_n, block_c = fmt.block
        s13 = _pad_rows(s13, halves, -(-padded // block_n), value=1.0)  # more block rows per half
        s2 = _pad_cols(s2, -(-padded // block_c), value=1.0)  # more block columns
    elif fmt.fp8 is not None:
        s13 = _pad_rows(s13, halves, padded, value=1.0)  # a scale per row
    return ExpertWeights(w13, w2, weights.gated, fmt, s13, s2, weights.input_scale)
