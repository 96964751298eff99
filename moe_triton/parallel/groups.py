"""A `ParallelSpec`'s process groups (after `init_process_group`), and the collectives on them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .spec import Collective, ParallelSpec, ReduceOver, Reduction

# torch 2.13 renamed reduce_scatter_tensor (deprecated); torch 2.11 (the H200 image) has only it
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ParallelGroups:
    spec: ParallelSpec
    rank: int  # this process in the layer's group (the default group)
    ep: dist.ProcessGroup  # same tp_rank: the other experts
    tp: dist.ProcessGroup  # same ep_rank: the other slices of I
    moe: dist.ProcessGroup  # all spec.world_size ranks

    @property
    def ep_rank(self) -> int:
        return self.spec.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.spec.coords(self.rank)[1]

    def group(self, over: ReduceOver) -> dist.ProcessGroup:
        return {ReduceOver.TP: self.tp, ReduceOver.EP: self.ep, ReduceOver.MOE: self.moe}[over]


def new_parallel_groups(spec: ParallelSpec) -> ParallelGroups:
    """The EP and TP groups of `spec` over the default group: a collective, same spec everywhere."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call "
                         "torch.distributed.init_process_group() first (under torchrun it reads "
                         "RANK / WORLD_SIZE / MASTER_ADDR from the environment)")
    if dist.get_world_size() != spec.world_size:
        raise ValueError(f"{spec} needs ep_size * tp_size = {spec.world_size} ranks, "
                         f"but the default group has {dist.get_world_size()}")
    ep, _ = dist.new_subgroups_by_enumeration(spec.ep_groups())
    tp, _ = dist.new_subgroups_by_enumeration(spec.tp_groups())
    return ParallelGroups(spec, dist.get_rank(), ep, tp, dist.group.WORLD)


def scattered_rows(num_tokens: int, group_size: int, index: int) -> range:
    """The rows rank `index` of a reduce-scatter keeps: ceil(T / W), the last short or empty."""
    chunk = -(-num_tokens // group_size)
    return range(min(index * chunk, num_tokens), min((index + 1) * chunk, num_tokens))


def reduce_partials(out: torch.Tensor, reduction: Reduction,
                    groups: ParallelGroups) -> torch.Tensor:
    """ALL_REDUCE sums `out` (T, H) in place; REDUCE_SCATTER returns its `scattered_rows`."""
    if reduction.collective is Collective.NONE:
        return out
    group = groups.group(reduction.over)
    if reduction.collective is Collective.ALL_REDUCE:
        dist.all_reduce(out, group=group)
        return out
    return _reduce_scatter_rows(out, group)


def _reduce_scatter_rows(out: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, index = dist.get_world_size(group), dist.get_rank(group)
    num_tokens, hidden = out.shape
    chunk = -(-num_tokens // size)
    if chunk * size != num_tokens:  # the collective needs equal chunks: zero rows, dropped below
        out = F.pad(out, (0, 0, 0, chunk * size - num_tokens))  # [W * chunk, H]
    mine = out.new_empty(chunk, hidden)  # [chunk, H]
    reduce_scatter_single(mine, out.contiguous(), group=group)
    return mine[: len(scattered_rows(num_tokens, size, index))]  # [<= chunk, H]
