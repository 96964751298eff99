"""Expert (EP) and tensor (TP) parallelism for the expert layer, on torch.distributed: every rank
routes its tokens, dispatches them (all_to_all.py), runs its shard (shard.py, experts.py), combines
and reduces (groups.py, as spec.py decides). Launch with torchrun; see docs/DISTRIBUTED.md."""
from .all_to_all import (
    Dispatched,
    DispatchPlan,
    Gathered,
    combine,
    combine_gathered,
    dispatch,
    dispatch_gathered,
)
from .experts import LocalExperts, ParallelExperts, parallel_experts, torch_experts
from .groups import ParallelGroups, new_parallel_groups, reduce_partials, scattered_rows
from .shard import (
    block_lead,
    compact_slots,
    local_sizes,
    localize_ids,
    shard_expert_weights,
    shard_experts,
    shard_state,
)
from .spec import (
    Collective,
    OutputLayout,
    ParallelSpec,
    ReduceOver,
    Reduction,
    TokenDispatch,
    post_experts_reduction,
)

__all__ = [
    "DispatchPlan", "Dispatched", "Gathered", "combine", "combine_gathered", "dispatch",
    "dispatch_gathered",
    "LocalExperts", "ParallelExperts", "parallel_experts", "torch_experts",
    "ParallelGroups", "new_parallel_groups", "reduce_partials", "scattered_rows",
    "block_lead", "compact_slots", "local_sizes", "localize_ids", "shard_expert_weights",
    "shard_experts", "shard_state",
    "Collective", "OutputLayout", "ParallelSpec", "ReduceOver", "Reduction", "TokenDispatch",
    "post_experts_reduction",
]
