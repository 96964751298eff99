"""Expert (EP) and tensor (TP) parallelism for the expert layer, on torch.distributed.

    [Router] (replicated, on every rank's own tokens)
      -> [Dispatch]  all_to_all.py  tokens to the EP ranks owning their experts (ALL_TO_ALL EP): synced
                                    eagerly, gathered at a fixed capacity inside CUDA-graph capture
      -> [Experts]   the local pipeline (run_experts or a backend's runner) on this rank's shard:
                     E/ep experts (EP), I/tp of each expert's intermediate columns (TP)   shard.py
      -> [Combine]   all_to_all.py  results back to their source rank, summed per token
      -> [Reduce]    groups.py      the one post-experts reduction spec.py decides: TP partial sums,
                                    REPLICATED EP partial sums; never after a reducing combine

    spec.py     ParallelSpec (ep_size, tp_size, TokenDispatch, OutputLayout), post_experts_reduction
    groups.py   ParallelGroups / new_parallel_groups, reduce_partials
    shard.py    shard_experts, shard_expert_weights (scales too), shard_state (cut on load), localize_ids, ...
    all_to_all.py  dispatch, combine (synced); dispatch_gathered, combine_gathered (capture-safe)
    experts.py  parallel_experts (functional), ParallelExperts (module), torch_experts

Legend: T tokens, E experts, K top-k, H hidden, I intermediate; ep / tp the group sizes.
Launch with torchrun; see docs/DISTRIBUTED.md.
"""
from .all_to_all import Dispatched, DispatchPlan, Gathered, combine, combine_gathered, dispatch, dispatch_gathered
from .experts import LocalExperts, ParallelExperts, parallel_experts, torch_experts
from .groups import ParallelGroups, new_parallel_groups, reduce_partials, scattered_rows
from .shard import block_lead, compact_slots, local_sizes, localize_ids, shard_expert_weights, shard_experts, shard_state
from .spec import Collective, OutputLayout, ParallelSpec, ReduceOver, Reduction, TokenDispatch, post_experts_reduction

__all__ = [
    "DispatchPlan", "Dispatched", "Gathered", "combine", "combine_gathered", "dispatch", "dispatch_gathered",
    "LocalExperts", "ParallelExperts", "parallel_experts", "torch_experts",
    "ParallelGroups", "new_parallel_groups", "reduce_partials", "scattered_rows",
    "block_lead", "compact_slots", "local_sizes", "localize_ids", "shard_expert_weights", "shard_experts", "shard_state",
    "Collective", "OutputLayout", "ParallelSpec", "ReduceOver", "Reduction", "TokenDispatch", "post_experts_reduction",
]
