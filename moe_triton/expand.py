"""Stage 2, expand: topk_ids [T, K] -> ExpertLayout, the (token, slot) pairs grouped by expert.

Segments are padded to block_m rows (a GEMM tile reads one expert), stable within an expert; the
first GEMM's loads gather hidden-state rows (no [M, H] copy). An id outside [0, E) (-1, or >= E:
the EP sentinel) is filtered: no row, pair_to_row -1, never out of bounds. Buffer sizes are worst
cases of (T, K, E, block_m): one grid for any routing (CUDA-graph safe).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton

from ._expand_kernels import (
    _expand_one_program_kernel,
    _expert_histogram_kernel,
    _expert_offsets_kernel,
    _scatter_pairs_kernel,
)
from .launch import BoundLaunch
from .platform import dependent_launch


class LayoutKind(enum.Enum):
    SORTED = "sorted"  # expand's layout: pairs grouped by expert, segments padded to block_m rows
    PER_PAIR = "per_pair"  # no sort: row block b holds pair b alone, in its first row (decode)
    # no sort: a GEMM program of expert e finds e's pairs in the routing itself; pair p at row p
    BY_EXPERT = "by_expert"


@dataclass(frozen=True)
class ExpertLayout:
    """Where each (token, slot) pair lives in the expert GEMMs' rows: P = T * K pairs, R = max_rows
    rows, B = R / block_m blocks. PER_PAIR and BY_EXPERT have no SORTED fields: pair p is at row
    p * pair_row_stride."""

    kind: LayoutKind
    block_m: int
    top_k: int  # K: pair p belongs to token p // K
    num_experts: int  # E: an id outside [0, E) is filtered
    num_pairs: int  # P, also the padding sentinel in sorted_pair_ids
    topk_ids: torch.Tensor  # [P] int32/int64: the routing, flattened (a view, never copied)
    sorted_pair_ids: torch.Tensor | None = None  # [R] int32: pair at row r, P for a padding row
    pair_to_row: torch.Tensor | None = None  # [P] int32: row of pair p, -1 for a filtered pair
    block_expert: torch.Tensor | None = None  # [B] int32: expert of block b, -1 past rows in use
    expert_offsets: torch.Tensor | None = None  # [E + 1] int32: first row of e; [E] = rows in use
    num_rows: torch.Tensor | None = None  # [1] int32: expert_offsets[E], read on device only
    # BY_EXPERT: [E, P_PAD] int32 scratch where each GEMM program lists its expert's pairs
    expert_pairs: torch.Tensor | None = None

    @property
    def pair_row_stride(self) -> int:
        """Unsorted: pair p's row is p times this (PER_PAIR: a block each; BY_EXPERT: a row); 0:
        SORTED, rows from pair_to_row."""
        return {LayoutKind.PER_PAIR: self.block_m, LayoutKind.BY_EXPERT: 1}.get(self.kind, 0)

    @property
    def max_rows(self) -> int:
        if self.kind is not LayoutKind.SORTED:
            return self.num_pairs * self.pair_row_stride
        return self.sorted_pair_ids.numel()

    def block_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted_pair_ids, block_expert, num_rows) as a GEMM kernel takes them; unsorted
        layouts' kernels read topk_ids only, so it stands in for those it does not read
        (BY_EXPERT: expert_pairs in sorted_pair_ids's place)."""
        if self.kind is LayoutKind.BY_EXPERT:
            return self.expert_pairs, self.topk_ids, self.topk_ids
        if self.kind is not LayoutKind.SORTED:
            return self.topk_ids, self.topk_ids, self.topk_ids
        return self.sorted_pair_ids, self.block_expert, self.num_rows


def per_pair_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """The decode layout, no kernel: each pair its own GEMM tile (best when few share an expert)."""
    return unsorted_layout(LayoutKind.PER_PAIR, topk_ids, num_experts, block_m)


def unsorted_layout(kind: LayoutKind, topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> ExpertLayout:
    """A PER_PAIR or BY_EXPERT layout of (T, K) `topk_ids`: no kernel, the routing as it is."""
    T, K = topk_ids.shape
    scratch = None
    if kind is LayoutKind.BY_EXPERT:
        scratch = torch.empty(num_experts * by_expert_pad(T * K), dtype=torch.int32,
                              device=topk_ids.device)
    return ExpertLayout(kind, block_m, K, num_experts, T * K, topk_ids.contiguous().view(-1),
                        expert_pairs=scratch)


def by_expert_pad(num_pairs: int) -> int:
    """BY_EXPERT's P_PAD: the routed ids a GEMM program scans at once, a power of two."""
    return triton.next_power_of_2(num_pairs)


@dataclass(frozen=True)
class UnsortedPlan:
    kind: LayoutKind  # PER_PAIR or BY_EXPERT
    num_experts: int  # E
    block_m: int

    def __call__(self, topk_ids: torch.Tensor) -> ExpertLayout:
        return unsorted_layout(self.kind, topk_ids, self.num_experts, self.block_m)


def layout_like(kind: LayoutKind, num_tokens: int, top_k: int, num_experts: int,
                block_m: int) -> ExpertLayout:
    """A (T, K, E, block_m) layout of meta tensors (sizes, no data): what plans are built from."""
    P = num_tokens * top_k

    def meta(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device="meta")

    if kind is not LayoutKind.SORTED:
        return ExpertLayout(kind, block_m, top_k, num_experts, P, meta(P),
                            expert_pairs=meta(num_experts * by_expert_pad(P))
                            if kind is LayoutKind.BY_EXPERT else None)
    R = max_rows(P, num_experts, block_m)
    return ExpertLayout(kind, block_m, top_k, num_experts, P, meta(P), meta(R), meta(P),
                        meta(R // block_m), meta(num_experts + 1), meta(1))


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst case of sum_e ceil(count_e / block_m) * block_m; at most min(E, P) experts are used."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def _block_p(num_experts: int) -> int:
    # The one-hot tiles are [BLOCK_P, E_PAD]; keep them near 8K elements so they stay in registers.
    return max(16, min(1024, 8192 // triton.next_power_of_2(num_experts)))


@dataclass(frozen=True)
class ExpandPlan:
    """`expand` for one (T, K, E, block_m): buffer sizes and launches bound once."""

    top_k: int  # K
    num_experts: int  # E
    block_m: int
    num_pairs: int  # P = T * K
    max_rows: int  # R, the worst case
    num_blocks: int  # blocks of BLOCK_P pairs (the histogram and scatter kernels take one each)
    # (one program) or (histogram, offsets, scatter); () when P = 0
    launches: tuple[BoundLaunch] | tuple[BoundLaunch, BoundLaunch, BoundLaunch] | tuple[()]

    def __call__(self, topk_ids: torch.Tensor) -> ExpertLayout:
        P, E, R, B = self.num_pairs, self.num_experts, self.max_rows, self.max_rows // self.block_m
        scratch = self.num_blocks * E if len(self.launches) == 3 else 0
        # One allocation (on the host one costs half a launch), the three-kernel path's scratch
        # last: [R], [P], [B], [E + 1], [1], [blocks * E] twice.
        buffers = torch.empty(R + P + B + E + 2 + 2 * scratch, dtype=torch.int32,
                              device=topk_ids.device)
        (sorted_pair_ids, pair_to_row, block_expert, expert_offsets, num_rows, block_counts,
         block_prefix) = buffers.split_with_sizes((R, P, B, E + 1, 1, scratch, scratch))
        topk_ids = topk_ids.contiguous()  # a no-op for the [T, K] tensors routing returns
        layout = ExpertLayout(LayoutKind.SORTED, self.block_m, self.top_k, E, P, topk_ids.view(-1),
                              sorted_pair_ids, pair_to_row, block_expert, expert_offsets, num_rows)
        written = dict(expert_offsets_ptr=expert_offsets, num_rows_ptr=num_rows,
                       sorted_pair_ids_ptr=sorted_pair_ids, block_expert_ptr=block_expert)
        if len(self.launches) == 1:
            self.launches[0](topk_ids_ptr=topk_ids, pair_to_row_ptr=pair_to_row, **written)
        elif self.launches:
            histogram, offsets, scatter = self.launches
            histogram(topk_ids_ptr=topk_ids, block_counts_ptr=block_counts)
            offsets(block_counts_ptr=block_counts, block_prefix_ptr=block_prefix, **written)
            scatter(topk_ids_ptr=topk_ids, block_prefix_ptr=block_prefix,
                    expert_offsets_ptr=expert_offsets, sorted_pair_ids_ptr=sorted_pair_ids,
                    pair_to_row_ptr=pair_to_row)
        else:
            expert_offsets.zero_()
            num_rows.zero_()
        return layout


# One program runs the stage for a single block of pairs (P <= 64 at E = 128, <= 1024 at E = 8):
# measured no slower than the three kernels there, slower beyond (docs/PERFORMANCE.md, issue 26).
ONE_PROGRAM_BLOCKS = 1


def plan_expand(num_tokens: int, top_k: int, num_experts: int, block_m: int,
                device: torch.device) -> ExpandPlan:
    """`device`: where it runs; on SM90 each kernel launches by PDL behind the one in front."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m <= 0 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    P, E = num_tokens * top_k, num_experts
    R = max_rows(P, E, block_m)
    BLOCK_P, E_PAD = _block_p(E), triton.next_power_of_2(E)
    num_blocks = triton.cdiv(P, BLOCK_P)
    chunk = max(1, 8192 // E_PAD)
    pairs = dict(num_pairs=P, E=E, E_PAD=E_PAD, CHAINED=dependent_launch(device))  # every kernel's
    per_block = pairs | dict(BLOCK_P=BLOCK_P)  # the kernels that cut the pairs in blocks
    layout = dict(num_blocks=num_blocks, num_m_blocks=R // block_m, BLOCK_M=block_m, CHUNK=chunk)
    if P == 0:
        launches = ()
    elif num_blocks <= ONE_PROGRAM_BLOCKS:
        launches = (BoundLaunch(_expand_one_program_kernel, (1,), per_block | layout),)
    else:
        launches = (
            BoundLaunch(_expert_histogram_kernel, (num_blocks,), per_block),
            BoundLaunch(_expert_offsets_kernel, (1,), pairs | layout),
            BoundLaunch(_scatter_pairs_kernel, (num_blocks,), per_block),
        )
    return ExpandPlan(top_k, E, block_m, P, R, num_blocks, launches)


def expand(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Sort the (T, K) pairs of `topk_ids` by expert into segments padded to `block_m` rows."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a 2-D int32/int64 tensor (T, K), "
                         f"got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    T, K = topk_ids.shape
    return plan_expand(T, K, num_experts, block_m, topk_ids.device)(topk_ids)


def expand_torch(topk_ids: torch.Tensor, num_experts: int,
                 block_m: int) -> dict[str, torch.Tensor]:
    """Reference: the same layout built with torch ops (stable order); rows in use only."""
    flat = topk_ids.reshape(-1).long()  # [P]
    P = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    sorted_pair_ids, pair_to_row, block_expert, offsets = (
        [], torch.full((P,), -1, dtype=torch.long), [], [0])
    for e in range(num_experts):
        pairs = torch.nonzero(valid & (flat == e)).flatten()  # [count_e]
        padded = triton.cdiv(pairs.numel(), block_m) * block_m
        pair_to_row[pairs] = offsets[-1] + torch.arange(pairs.numel())
        sorted_pair_ids += pairs.tolist() + [P] * (padded - pairs.numel())
        block_expert += [e] * (padded // block_m)
        offsets.append(offsets[-1] + padded)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return dict(
        sorted_pair_ids=as_int(sorted_pair_ids), pair_to_row=pair_to_row.int(),
        block_expert=as_int(block_expert), expert_offsets=as_int(offsets),
    )
