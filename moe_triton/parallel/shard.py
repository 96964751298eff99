"""Which experts and which slice of I a rank holds: sharding full weights, and localising ids.

EP cuts whole experts: rank ep_rank owns global experts [ep_rank * E/ep, (ep_rank + 1) * E/ep).
TP cuts I: rank tp_rank owns columns [tp_rank * I/tp, (tp_rank + 1) * I/tp) of every expert,
taken from the gate half and from the up half of w13 = [gate; up] separately, so the local w13 is
again [gate slice; up slice] and the gated activation pairs the right rows. The slice is taken
before any backend padding: a backend pads I/tp as it would pad any I (7688 / 8 = 961).
"""
from __future__ import annotations

import torch

from ..activation import SILU_AND_MUL, Activation
from .spec import ParallelSpec


def local_sizes(num_experts: int, intermediate_size: int, spec: ParallelSpec) -> tuple[int, int]:
    """(E / ep_size, I / tp_size), or a ValueError saying which does not divide."""
    if num_experts % spec.ep_size:
        raise ValueError(f"E={num_experts} experts do not split evenly over ep_size={spec.ep_size} ranks")
    if intermediate_size % spec.tp_size:
        raise ValueError(f"intermediate size I={intermediate_size} does not split evenly "
                         f"over tp_size={spec.tp_size} ranks")
    return num_experts // spec.ep_size, intermediate_size // spec.tp_size


def shard_experts(w13: torch.Tensor, w2: torch.Tensor, spec: ParallelSpec, rank: int, *,
                  activation: Activation = SILU_AND_MUL) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s fresh, contiguous (w13 (E/ep, 2I/tp, H), w2 (E/ep, H, I/tp)) of the full
    w13 (E, 2I, H) [gate; up] (or (E, I, H) non-gated) and w2 (E, H, I).

    Slice on the host and move the result: only this rank's share is copied to the device.
    """
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 (E, 2I, H) and w2 (E, H, I) must be 3-D with equal E, "
                         f"got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, rows, _ = w13.shape
    intermediate = w2.shape[2]
    if rows != (2 * intermediate if activation.gated else intermediate):
        raise ValueError(f"w13 has {rows} rows but w2 has I={intermediate}: expected "
                         f"{'2I [gate; up]' if activation.gated else 'I'} rows for {activation.kind.name}")
    experts_per_rank, cols_per_rank = local_sizes(num_experts, intermediate, spec)
    ep_rank, tp_rank = spec.coords(rank)
    experts = slice(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)
    cols = slice(tp_rank * cols_per_rank, (tp_rank + 1) * cols_per_rank)
    w13, w2 = w13[experts], w2[experts]
    if activation.gated:
        gate, up = w13[:, :intermediate], w13[:, intermediate:]
        w13_local = torch.cat([gate[:, cols], up[:, cols]], dim=1)  # [E/ep, 2I/tp, H]
    else:
        w13_local = w13[:, cols].clone(memory_format=torch.contiguous_format)  # [E/ep, I/tp, H]
    return w13_local, w2[:, :, cols].clone(memory_format=torch.contiguous_format)  # [E/ep, H, I/tp]


def localize_ids(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global ids (T, K) -> this rank's local ids (T, K) int32; -1 (filtered) where the expert lives elsewhere."""
    local = topk_ids.long() - first_expert  # [T, K]
    return torch.where((local >= 0) & (local < num_local), local, -1).int()  # [T, K]


def compact_slots(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids (T, K) with K > E/ep -> (T, E/ep) ids and weights, local slots first.

    fused_experts takes top-k <= its own E, but with E/ep < K experts per rank a row keeps its
    local slots only. A row holds distinct ids (every router yields them), so at most E/ep slots
    are local: the cut drops only filtered ones. No host sync, so graph capture still works.
    """
    if topk_ids.shape[1] <= num_local:
        return topk_ids, topk_weights
    filtered = (topk_ids < 0) | (topk_ids >= num_local)  # [T, K]
    order = filtered.to(torch.uint8).argsort(dim=1, stable=True)[:, :num_local]  # [T, E/ep]
    return topk_ids.gather(1, order), topk_weights.gather(1, order)  # [T, E/ep] each


def shard_state(state: dict[str, torch.Tensor], names: tuple[str, str], local_shapes: tuple[torch.Size, torch.Size],
                num_experts: int, spec: ParallelSpec, rank: int, activation: Activation) -> None:
    """Replace full-size expert tensors `state[names[0]]` (E, 2I, H) and `state[names[1]]` (E, H, I)
    by rank `rank`'s shard, in place; a state already holding shards (`local_shapes`), lacking the
    names, or malformed (the caller's shape check names it) is left as it is."""
    if not all(name in state for name in names):
        return
    w13, w2 = (state[name] for name in names)
    if (w13.shape, w2.shape) == tuple(local_shapes):
        return  # already this rank's shard
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != num_experts:
        return
    state[names[0]], state[names[1]] = shard_experts(w13, w2, spec, rank, activation=activation)

