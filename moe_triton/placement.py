"""Where a model's MoE layers run (backend, model context, ranks): one value for all of them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .context import ModelContext
from .parallel import OutputLayout, ParallelGroups, local_sizes, shard_state
from .platform import Platform
from .weights import NATIVE, ExpertWeights, WeightFormat


@dataclass(frozen=True)
class Placement:
    backend: str = "auto"  # "auto" or a backend's name (moe_triton.runners)
    context: ModelContext = field(default_factory=ModelContext)  # what backend choice reads
    parallel: ParallelGroups | None = None  # experts sharded over ranks; None: one device
    platform: Platform | None = None  # None: detected from the weights' device

    def __post_init__(self):
        if self.parallel is not None and self.parallel.spec.output is not OutputLayout.FULL:
            raise ValueError(f"parallel.spec.output is {self.parallel.spec.output.value}; "
                             "a MoE layer returns every token's full row (shared experts and the "
                             "residual add to it): use OutputLayout.FULL, or "
                             "moe_triton.parallel.parallel_experts directly for a scattered output")

    def resolution_context(self) -> ModelContext:
        """The model's context, plus whether moe_triton.parallel shards the experts."""
        return (replace(self.context, sharded_experts=True) if self.parallel is not None
                else self.context)

    def local_sizes(self, num_experts: int, intermediate_size: int,
                    weight_format: WeightFormat = NATIVE) -> tuple[int, int]:
        if self.parallel is None:
            return num_experts, intermediate_size
        return local_sizes(num_experts, intermediate_size, self.parallel.spec, self.parallel.rank,
                           weight_format)

    def cut_shard(self, state: dict[str, torch.Tensor], names: dict[str, str], local: ExpertWeights,
                  sizes: tuple[int, int]) -> None:
        """Full-size `state[names[field]]` of (E, I) = `sizes` -> this rank's `local`, in place."""
        if self.parallel is not None:
            shard_state(state, names, local, sizes, self.parallel.spec, self.parallel.rank)
