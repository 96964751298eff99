"""The experts of one MoE layer across ranks, around any local pipeline (docs/DISTRIBUTED.md)."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .. import checks
from ..activation import SILU_AND_MUL, Activation
from ..graphs.capture import gathered_dispatch
from ..pipeline import run_experts
from ..reference import fused_experts_torch
from ..weights import ExpertWeights
from .all_to_all import combine, combine_gathered, dispatch, dispatch_gathered
from .groups import ParallelGroups, reduce_partials
from .shard import compact_slots, local_sizes, localize_ids, shard_experts
from .spec import post_experts_reduction

# (x [T, H], shard, local ids [T, K], weights [T, K]) -> [T, H], x's dtype: run_experts or a runner
LocalExperts = Callable[[torch.Tensor, ExpertWeights, torch.Tensor, torch.Tensor], torch.Tensor]


def torch_experts(hidden_states, weights: ExpertWeights, topk_ids, topk_weights, *,
                  activation: Activation = SILU_AND_MUL):
    """The float32 reference as a local pipeline: run_experts' signature and output dtype."""
    out = fused_experts_torch(hidden_states, weights.w13, weights.w2, topk_ids, topk_weights,
                              activation=activation)  # [T, H] float32
    return out.to(hidden_states.dtype)


def parallel_experts(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    groups: ParallelGroups,
    *,
    experts: LocalExperts,
) -> torch.Tensor:
    """A collective (T may be 0): this rank's tokens (T, H) and global ids through all ranks'
    experts -> a fresh (T, H) or its `scattered_rows`; a capture takes the gathered dispatch."""
    if (hidden_states.dim() != 2 or topk_ids.dim() != 2
            or topk_ids.shape[0] != hidden_states.shape[0]):
        raise ValueError(f"hidden_states must be (T, H) and topk_ids (T, K) with the same T, "
                         f"got {tuple(hidden_states.shape)} and {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    checks.no_grad_needed("moe_triton.parallel", "train on one rank", hidden_states, topk_weights,
                          weights.w13, weights.w2)  # the collectives are not differentiated
    spec = groups.spec
    num_local = weights.num_experts
    # fixed shapes, no host read: the decode graphs' way
    if spec.all_to_all and gathered_dispatch():
        sent = dispatch_gathered(hidden_states, topk_ids, topk_weights, groups.ep)
        ids = localize_ids(sent.topk_ids, groups.ep_rank * num_local, num_local)  # [W * T, K]
        ids, slot_weights = compact_slots(ids, sent.topk_weights,
                                          num_local)  # [W * T, min(K, E/ep)]
        y = experts(sent.hidden_states, weights, ids, slot_weights)  # [W * T, H], local experts
        out = combine_gathered(y, groups.ep)  # [T, H], summed over EP
    elif spec.all_to_all:
        sent = dispatch(hidden_states, topk_ids, topk_weights, num_local, groups.ep)
        ids, slot_weights = compact_slots(sent.topk_ids, sent.topk_weights,
                                          num_local)  # [Tr, min(K, E/ep)]
        y = experts(sent.hidden_states, weights, ids, slot_weights)  # [Tr, H]
        out = combine(y, sent.plan, groups.ep)  # [T, H], summed over EP
    else:
        ids = (localize_ids(topk_ids, groups.ep_rank * num_local, num_local)
               if spec.ep_size > 1 else topk_ids)  # [T, K]
        ids, slot_weights = compact_slots(ids, topk_weights, num_local)  # [T, min(K, E/ep)]
        out = experts(hidden_states, weights, ids, slot_weights)  # [T, H], partial
    return reduce_partials(out, post_experts_reduction(spec), groups)


class ParallelExperts(nn.Module):
    """One rank's shard of a layer's experts (FusedMoE's names); no grad: collectives have none."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 groups: ParallelGroups, *,
                 activation: Activation = SILU_AND_MUL, experts: LocalExperts | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        experts_per_rank, cols_per_rank = local_sizes(num_experts, intermediate_size, groups.spec)
        rows = 2 * cols_per_rank if activation.gated else cols_per_rank
        factory = dict(dtype=dtype, device=device)
        w13 = torch.empty(experts_per_rank, rows, hidden_size, **factory)  # [E/ep, 2I/tp, H]
        w2 = torch.empty(experts_per_rank, hidden_size, cols_per_rank, **factory)  # [E/ep, H, I/tp]
        self.gate_up_proj = nn.Parameter(w13, requires_grad=False)
        self.down_proj = nn.Parameter(w2, requires_grad=False)
        self.num_experts = num_experts
        self.groups = groups
        self.activation = activation
        self.local_experts = experts or partial(run_experts, activation=activation)

    @classmethod
    def from_full(cls, w13: torch.Tensor, w2: torch.Tensor, groups: ParallelGroups, *,
                  activation: Activation = SILU_AND_MUL, experts: LocalExperts | None = None,
                  device: torch.device | str | None = None) -> ParallelExperts:
        module = cls(w13.shape[0], w13.shape[2], w2.shape[2], groups, activation=activation,
                     experts=experts, dtype=w13.dtype, device=device or w13.device)
        local_w13, local_w2 = shard_experts(w13, w2, groups.spec, groups.rank,
                                            activation=activation)
        module.gate_up_proj.copy_(local_w13)
        module.down_proj.copy_(local_w2)
        return module

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        weights = ExpertWeights(self.gate_up_proj, self.down_proj, gated=self.activation.gated)
        return parallel_experts(hidden_states, weights, topk_ids, topk_weights, self.groups,
                                experts=self.local_experts)
