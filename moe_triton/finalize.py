"""Stage 5, finalize: un-permute and sum each token's K weighted expert outputs.

    out[t, :] = sum_j topk_weights[t, j] * y[pair_to_row[t * K + j], :]   (filtered pairs skipped)

Always a fresh output (stream overlap relies on it); float32 sums in slot order: bit-stable."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .expand import ExpertLayout, LayoutKind
from .launch import BoundLaunch, interpreter_serialized
from .platform import wait_then_release


@interpreter_serialized
@triton.jit
def _finalize_kernel(
    y_ptr, topk_weights_ptr, pair_to_row_ptr, topk_ids_ptr, out_ptr,
    T, H, E, stride_y_split, stride_y_r, stride_w_t, stride_w_k, stride_out_t,
    # PAIR_ROW_STRIDE 0: rows from pair_to_row; m > 0: pair p at row p * m when its id is in [0, E)
    PAIR_ROW_STRIDE: tl.constexpr,
    Y_SPLITS: tl.constexpr,  # split-C partials per row of y (1: plain rows)
    SPLIT_BLOCK: tl.constexpr,  # > 1: partials read SPLIT_BLOCK at a time (a loop's latency each)
    CHAINED: tl.constexpr,  # launched by PDL behind y's kernel: wait for it, release the next
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    wait_then_release(CHAINED)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_token = tokens < T
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pairs = tokens * TOP_K + j
        if PAIR_ROW_STRIDE > 0:
            ids = tl.load(topk_ids_ptr + pairs, mask=is_token, other=-1)
            row = tl.where((ids >= 0) & (ids < E), pairs * PAIR_ROW_STRIDE, -1)
        else:
            row = tl.load(pair_to_row_ptr + pairs, mask=is_token, other=-1)
        routed = row >= 0  # a filtered pair (row -1) adds nothing, whatever its weight
        weight = tl.load(topk_weights_ptr + tokens * stride_w_t + j * stride_w_k, mask=routed,
                         other=0.0)
        y_tile = y_ptr + row[:, None].to(tl.int64) * stride_y_r + cols[None, :]
        y_mask = routed[:, None] & (cols[None, :] < H)
        if SPLIT_BLOCK > 1:  # many partials: SPLIT_BLOCK of them a load, summed as a tree
            splits = tl.arange(0, SPLIT_BLOCK)
            y = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for first in range(0, Y_SPLITS, SPLIT_BLOCK):
                s_ok = first + splits < Y_SPLITS
                block = tl.load(y_tile[:, None, :] + (first + splits)[None, :, None]
                                * stride_y_split, mask=y_mask[:, None, :] & s_ok[None, :, None],
                                other=0.0)  # [BLOCK_T, SPLIT_BLOCK, BLOCK_H]
                y += tl.sum(block, axis=1)
        else:
            y = tl.load(y_tile, mask=y_mask, other=0.0).to(tl.float32)
            for s in tl.static_range(1, Y_SPLITS):
                y += tl.load(y_tile + s * stride_y_split, mask=y_mask, other=0.0)
        acc += y * weight.to(tl.float32)[:, None]
    out = out_ptr + tokens[:, None].to(tl.int64) * stride_out_t + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_token[:, None] & (cols[None, :] < H))


@dataclass(frozen=True)
class FinalizePlan:

    out_shape: tuple[int, int]  # [T, H]
    out_dtype: torch.dtype
    launch: BoundLaunch | None  # None: no tokens or no columns

    def __call__(self, y: torch.Tensor, topk_weights: torch.Tensor, layout: ExpertLayout,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=y.device)  # [T, H]
        if self.launch is not None:
            # An unsorted layout has no pair_to_row: the kernel reads topk_ids there instead.
            pair_to_row = (layout.topk_ids if layout.kind is not LayoutKind.SORTED
                           else layout.pair_to_row)
            self.launch(y_ptr=y, topk_weights_ptr=topk_weights, pair_to_row_ptr=pair_to_row,
                        topk_ids_ptr=layout.topk_ids, out_ptr=out)
        return out


def plan_finalize(y: torch.Tensor, topk_weights: torch.Tensor, layout: ExpertLayout,
                  out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                  chained: bool = False) -> FinalizePlan:
    """The plan of `finalize` (see there); calls given an `out` must pass one of its row stride.
    `chained`: launched by PDL right behind y's kernel, which must let it (platform.py)."""
    T = layout.num_pairs // max(layout.top_k, 1)
    H = y.shape[-1]
    out_dtype = out_dtype or y.dtype
    if T == 0 or H == 0:
        return FinalizePlan((T, H), out_dtype, None)
    splits = y.shape[0] if y.dim() == 3 else 1
    BLOCK_T = 16 if T >= 16 else triton.next_power_of_2(T)
    BLOCK_H = min(256, triton.next_power_of_2(H))
    SPLIT_BLOCK = 1
    if splits > 2:  # the decode kernel's slices: a program per token and 64 columns
        BLOCK_T, BLOCK_H = 1, min(64, BLOCK_H)
        SPLIT_BLOCK = min(32, triton.next_power_of_2(splits))
    fixed = dict(
        T=T, H=H, E=layout.num_experts, stride_y_split=y.stride(0) if y.dim() == 3 else 0,
        stride_y_r=y.stride(-2),
        stride_w_t=topk_weights.stride(0), stride_w_k=topk_weights.stride(1),
        stride_out_t=out.stride(0) if out is not None else H,
        PAIR_ROW_STRIDE=layout.pair_row_stride, Y_SPLITS=splits, SPLIT_BLOCK=SPLIT_BLOCK,
        CHAINED=chained,
        TOP_K=layout.top_k, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H,
    )
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(H, BLOCK_H))
    return FinalizePlan((T, H), out_dtype, BoundLaunch(_finalize_kernel, grid, fixed))


def finalize(y: torch.Tensor, topk_weights: torch.Tensor, layout: ExpertLayout, *,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """`y` (R, H), or split-C partials (S, R, H) float32, into (T, H) of `out_dtype` (default y's).
    A given `out` must be a fresh (T, H) buffer of unit last stride; it is fully overwritten."""
    plan = plan_finalize(y, topk_weights, layout, out_dtype, out)
    if out is not None and (tuple(out.shape) != plan.out_shape or out.stride(1) != 1):
        raise ValueError(f"out must have shape {plan.out_shape} and unit last stride, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    return plan(y, topk_weights, layout, out)


def finalize_torch(y: torch.Tensor, topk_weights: torch.Tensor, pair_to_row: torch.Tensor,
                   top_k: int):
    T = pair_to_row.numel() // max(top_k, 1)
    rows = pair_to_row.long().view(T, top_k)  # [T, K]
    routed = (rows >= 0).unsqueeze(-1)  # [T, K, 1]
    gathered = y.float()[rows.clamp(min=0)]  # [T, K, H]
    weighted = torch.where(routed, gathered * topk_weights.float().unsqueeze(-1), 0.0)
    return weighted.sum(dim=1)  # [T, H]
