"""The parallel setup as data, and the one decision that depends on it: the post-experts reduction.

W = ep_size * tp_size ranks form a grid, TP innermost, so a TP group is W consecutive ranks and
stays inside one node when tp_size divides the GPUs per node (its all-reduce is the chattiest):

    rank = ep_rank * tp_size + tp_rank
    EP group: the ep_size ranks sharing a tp_rank (same slice of I, different experts)
    TP group: the tp_size ranks sharing an ep_rank (same experts, different slices of I)

`post_experts_reduction` is the only place that decides which collective sums partial outputs
after the experts. Its cases are tested as a table (tests/test_distributed.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class TokenDispatch(enum.Enum):
    """How tokens reach the EP ranks that hold their experts (unused when ep_size == 1)."""
    ALL_TO_ALL = "all_to_all"  # each rank sends its own tokens to the owners; the combine sums them back home
    REPLICATED = "replicated"  # every EP rank holds the same tokens, runs its own experts; partials summed after


class OutputLayout(enum.Enum):
    """What a rank keeps of the reduced output, when the reduction spans ranks that hold the same tokens."""
    FULL = "full"  # every rank keeps all its T rows: all-reduce
    SCATTERED = "scattered"  # rank i of the reducing group keeps row chunk i (sequence parallel next): reduce-scatter


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
    ep_size: int = 1  # ranks sharing the experts: each owns E / ep_size of them
    tp_size: int = 1  # ranks sharing each expert's intermediate dimension: each owns I / tp_size
    dispatch: TokenDispatch = TokenDispatch.ALL_TO_ALL
    output: OutputLayout = OutputLayout.FULL

    def __post_init__(self):
        sizes = (self.ep_size, self.tp_size)
        if not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise ValueError(f"ParallelSpec.ep_size and tp_size must be integers >= 1, got {self}")
        if not isinstance(self.dispatch, TokenDispatch) or not isinstance(self.output, OutputLayout):
            raise ValueError(f"ParallelSpec.dispatch / output must be TokenDispatch / OutputLayout members, got {self}")

    @property
    def world_size(self) -> int:
        return self.ep_size * self.tp_size

    @property
    def all_to_all(self) -> bool:
        """Tokens travel by all-to-all: EP is on and the dispatch says so."""
        return self.ep_size > 1 and self.dispatch is TokenDispatch.ALL_TO_ALL

    def coords(self, rank: int) -> tuple[int, int]:
        """(ep_rank, tp_rank) of a rank of the layer's group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of {self}")
        return divmod(rank, self.tp_size)

    def tp_groups(self) -> list[list[int]]:
        """The ranks of each TP group, one list per ep_rank."""
        return [[e * self.tp_size + t for t in range(self.tp_size)] for e in range(self.ep_size)]

    def ep_groups(self) -> list[list[int]]:
        """The ranks of each EP group, one list per tp_rank."""
        return [[e * self.tp_size + t for e in range(self.ep_size)] for t in range(self.tp_size)]


def post_experts_reduction(spec: ParallelSpec) -> Reduction:
    """Which collective turns this rank's expert output into the layer's output.

    Partial sums of the same tokens are left on TP ranks (each summed over its slice of I) and on
    REPLICATED EP ranks (each summed over its own experts). The all-to-all combine has already
    summed the EP partials onto each token's own rank: reducing over EP again would add every
    output to copies of itself (double counting; in bf16 large activations overflow to inf).
    """
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
    collective = Collective.REDUCE_SCATTER if spec.output is OutputLayout.SCATTERED else Collective.ALL_REDUCE
    return Reduction(collective, over)
