"""Which experts and slice of I a rank holds: EP rank e owns experts [e * E/ep, + E/ep), TP rank t
columns [t * I/tp, + I/tp) of gate and of up, before backend padding. A BLOCK slice starting in a
block gets `block_lead` zero columns in front (each local block is a global one; act(0) * 0 = 0)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..activation import SILU_AND_MUL, Activation
from ..weights import NATIVE, ExpertWeights, WeightFormat
from .spec import ParallelSpec


def local_sizes(num_experts: int, intermediate_size: int, spec: ParallelSpec, rank: int = 0,
                weight_format: WeightFormat = NATIVE) -> tuple[int, int]:
    if num_experts % spec.ep_size:
        raise ValueError(f"E={num_experts} experts do not split evenly over "
                         f"ep_size={spec.ep_size} ranks")
    if intermediate_size % spec.tp_size:
        raise ValueError(f"intermediate size I={intermediate_size} does not split evenly "
                         f"over tp_size={spec.tp_size} ranks")
    lead = block_lead(weight_format, intermediate_size, spec, rank)
    return num_experts // spec.ep_size, intermediate_size // spec.tp_size + lead


def block_lead(weight_format: WeightFormat, intermediate_size: int, spec: ParallelSpec,
               rank: int) -> int:
    """Zero columns of I before rank `rank`'s TP slice that put it on the block grid (or 0)."""
    return weight_format.grid_lead(spec.coords(rank)[1] * (intermediate_size // spec.tp_size))


def shard_experts(w13: torch.Tensor, w2: torch.Tensor, spec: ParallelSpec, rank: int, *,
                  activation: Activation = SILU_AND_MUL) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (w13, w2), sliced on the host: only its share is copied to the device."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 (E, 2I, H) and w2 (E, H, I) must be 3-D with equal E, "
                         f"got {tuple(w13.shape)} and {tuple(w2.shape)}")
    rows, intermediate = w13.shape[1], w2.shape[2]
    if rows != (2 * intermediate if activation.gated else intermediate):
        raise ValueError(f"w13 has {rows} rows but w2 has I={intermediate}: expected "
                         f"{'2I [gate; up]' if activation.gated else 'I'} rows for "
                         f"{activation.kind.name}")
    local_sizes(w13.shape[0], intermediate, spec)  # says which does not divide
    shard = shard_expert_weights(ExpertWeights(w13, w2, activation.gated), spec, rank)
    return shard.w13, shard.w2


def shard_expert_weights(weights: ExpertWeights, spec: ParallelSpec, rank: int) -> ExpertWeights:
    """Rank `rank`'s fresh shard in any format: E/ep experts, I/tp + block_lead columns, scales."""
    E, I = weights.num_experts, weights.intermediate_size
    experts_per_rank, cols_per_rank = local_sizes(E, I, spec)
    ep_rank, tp_rank = spec.coords(rank)
    first = ep_rank * experts_per_rank
    experts = weights.select_experts(slice(first, first + experts_per_rank))
    lead = block_lead(weights.format, I, spec, rank)
    shard = experts.narrow_intermediate(tp_rank * cols_per_rank, cols_per_rank, lead)  # I/tp + lead
    if shard.w2_bias is not None and tp_rank > 0:  # the TP all-reduce sums ranks: one adds it
        shard = replace(shard, w2_bias=torch.zeros_like(shard.w2_bias))
    return shard


def localize_ids(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global ids (T, K) -> this rank's local ids (T, K) int32; -1 (filtered) elsewhere."""
    local = topk_ids.long() - first_expert  # [T, K]
    return torch.where((local >= 0) & (local < num_local), local, -1).int()  # [T, K]


def compact_slots(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids (T, K), K > E/ep -> (T, E/ep), local slots first (fused_experts takes K <= E):
    a row's ids are distinct, so only filtered slots are cut. No host sync: capture works."""
    if topk_ids.shape[1] <= num_local:
        return topk_ids, topk_weights
    filtered = (topk_ids < 0) | (topk_ids >= num_local)  # [T, K]
    order = filtered.to(torch.uint8).argsort(dim=1, stable=True)[:, :num_local]  # [T, E/ep]
    return topk_ids.gather(1, order), topk_weights.gather(1, order)  # [T, E/ep] each


def shard_state(state: dict[str, torch.Tensor], names: dict[str, str], local: ExpertWeights,
                sizes: tuple[int, int], spec: ParallelSpec, rank: int) -> None:
    """Full-size (`sizes` = (E, I)) expert tensors in `state` -> rank `rank`'s shard in place;
    anything else (missing, shards already, malformed) is left as it is."""
    present = {field: state[key] for field, key in names.items() if key in state}
    if "w13" not in present or "w2" not in present:
        return
    w13, w2 = present["w13"], present["w2"]
    # w2's last dim holds I values at the format's packing (MXFP4: two a byte)
    if (w13.dim() != 3 or w2.dim() != 3
            or (w13.shape[0], w2.shape[2] * local.format.packing) != tuple(sizes)):
        return
    try:
        full = ExpertWeights(gated=local.gated, format=local.format, **present)
    except ValueError:
        return
    shard = shard_expert_weights(full, spec, rank)
    for field, key in names.items():
        if key in state:
            state[key] = getattr(shard, field)
