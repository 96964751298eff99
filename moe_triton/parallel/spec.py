"""The parallel setup as data, and the post-experts reduction. rank = ep_rank * tp_size + tp_rank:
TP innermost, so a TP group (the chattiest all-reduce) stays in a node when tp_size divides it."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class TokenDispatch(enum.Enum):
    """How tokens reach the EP ranks holding their experts (unused when ep_size == 1)."""
    ALL_TO_ALL = "all_to_all"  # tokens sent to their experts' owners, the combine sums them home
    REPLICATED = "replicated"  # every EP rank holds all tokens; partials summed after


class OutputLayout(enum.Enum):
    """What a rank keeps of an output reduced over ranks holding the same tokens."""
    FULL = "full"  # every rank keeps all its T rows: all-reduce
    SCATTERED = "scattered"  # rank i keeps row chunk i (sequence parallel next): reduce-scatter


class Collective(enum.Enum):
    NONE = "none"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"


class ReduceOver(enum.Enum):
    TP = "tp"  # the ranks holding the other slices of I of the same experts
    EP = "ep"  # the ranks holding the other experts, same tokens (REPLICATED dispatch)
    MOE = "moe"  # all W ranks of the layer: TP and REPLICATED EP partials at once


@dataclass(frozen=True)
class Reduction:
    collective: Collective
    over: ReduceOver | None = None  # None exactly when collective is NONE


@dataclass(frozen=True)
class ParallelSpec:
    ep_size: int = 1  # ranks sharing the experts: each owns E / ep_size
    tp_size: int = 1  # ranks sharing each expert's I: each owns I / tp_size
    dispatch: TokenDispatch = TokenDispatch.ALL_TO_ALL
    output: OutputLayout = OutputLayout.FULL

    def __post_init__(self):
        sizes = (self.ep_size, self.tp_size)
        if not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise ValueError(f"ParallelSpec.ep_size and tp_size must be integers >= 1, got {self}")
        if (not isinstance(self.dispatch, TokenDispatch)
                or not isinstance(self.output, OutputLayout)):
            raise ValueError("ParallelSpec.dispatch / output must be TokenDispatch / OutputLayout "
                             f"members, got {self}")

    @property
    def world_size(self) -> int:
        return self.ep_size * self.tp_size

    @property
    def all_to_all(self) -> bool:
        return self.ep_size > 1 and self.dispatch is TokenDispatch.ALL_TO_ALL

    def coords(self, rank: int) -> tuple[int, int]:
        """(ep_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of {self}")
        return divmod(rank, self.tp_size)

    def tp_groups(self) -> list[list[int]]:
        return [[e * self.tp_size + t for t in range(self.tp_size)] for e in range(self.ep_size)]

    def ep_groups(self) -> list[list[int]]:
        return [[e * self.tp_size + t for e in range(self.ep_size)] for t in range(self.tp_size)]


def post_experts_reduction(spec: ParallelSpec) -> Reduction:
    """Partials are left on TP and REPLICATED EP ranks; all-to-all already summed EP partials
    home, and reducing over EP again double counts (in bf16 large activations overflow to inf)."""
    partial_over_ep = spec.ep_size > 1 and spec.dispatch is TokenDispatch.REPLICATED
    partial_over_tp = spec.tp_size > 1
    if partial_over_ep and partial_over_tp:
        over = ReduceOver.MOE
    elif partial_over_ep:
        over = ReduceOver.EP
    elif partial_over_tp:
        over = ReduceOver.TP
    else:  # one rank, or all-to-all EP alone: outputs are complete where they land
        return Reduction(Collective.NONE)
    collective = (Collective.REDUCE_SCATTER if spec.output is OutputLayout.SCATTERED
                  else Collective.ALL_REDUCE)
    return Reduction(collective, over)
