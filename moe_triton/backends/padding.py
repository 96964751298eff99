"""Alignment padding: zero-pad the experts' intermediate size I up to a backend's multiple.

Kernels need the per-partition I to be a multiple of their tile (CUTLASS MoE 16, trtllm-gen 128;
the multiple is `BackendSpec.intermediate_multiple`), and real checkpoints break it: NemotronH
FP8 has moe_intermediate_size 7688, 961 per partition at tensor-parallel 8.

    gated     gate_up_proj (E, 2I, H) = [gate; up] -> [gate | 0; up | 0]  (E, 2I', H)
    non-gated up_proj      (E, I, H)               -> [up | 0]            (E, I', H)
    down_proj (E, H, I)                            -> [down | 0]          (E, H, I')

Exact: a zero gate row and a zero up row give act(0) * 0 = 0 (relu(0)^2 = 0 for non-gated),
and the zero down_proj columns multiply it anyway. Padding the concatenation [gate; up] as one
block would instead shift the up half into the gate half's rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    extra = padded_size(I, multiple) - I
    if extra == 0:
        return w13, w2
    if gated:
        gate, up = w13.split(I, dim=1)  # [E, I, H] each
        w13 = torch.cat([F.pad(gate, (0, 0, 0, extra)), F.pad(up, (0, 0, 0, extra))], dim=1)  # [E, 2I', H]
    else:
        w13 = F.pad(w13, (0, 0, 0, extra))  # [E, I', H]
    return w13, F.pad(w2, (0, extra))  # [E, H, I']
