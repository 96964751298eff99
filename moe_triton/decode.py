"""Stages 2-5 at decode (a few tokens): the whole expert layer in one persistent launch.

    out[t] = sum_k topk_weights[t, k] * act(x[t] @ w13[e].T) @ w2[e].T      e = topk_ids[t, k]

A grid of at most one program per SM walks two phases over the row blocks in use (PER_PAIR: the
routed pairs, compacted in the kernel, so an expert-parallel shard's filtered slots cost nothing;
SORTED: expand's blocks). Up: units (row block, BLOCK_N intermediate columns) dealt round-robin,
each a TMA stream of w13 tiles that are the MMA's 64-row operand, every token one of its 16+
columns (x's tiles then do not depend on the unit); the activation in registers, h stored by
block row. A grid barrier (an arrival count and a generation; the last to arrive resets the
count: graph-safe). Down: units (row block, BLOCK_H output columns), streaming w2 tiles and the
block's h tile over all of I; the pair's float32 row is stored, and the last of a token's routed
pairs to reach that column block (a counter per token and block, acquire-release, back to zero
after) adds them, weighted, in slot order into out. One launch instead of expand (PER_PAIR),
quantize, up, down and finalize; every sum in a fixed order: the bits do not depend on timing.
FP8 (128, 128)-block weights are converted to the activations' dtype in registers, a scale per
tile (W8A16: nothing quantizes the activations).

The interpreter runs programs one after another, so its barrier would never open: there the
phases are two launches (PHASES 1, then 2); on a GPU one cooperative launch (PHASES 3: CUDA
refuses a grid that cannot be resident at once rather than hang). A plan's scratch and counters
are its own: its calls must not overlap in time (one stream).

Opt-in (config.decode_config): on the H200 it measured 1.02-1.29x the two GEMMs' time in bf16 and
2.3-2.7x in FP8 (docs/PERFORMANCE.md, "The persistent decode kernel (issue 28, continued)").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._expert_gemm_kernels import _dot
from .activation import Activation, _apply_activation, activation_torch
from .config import DecodeConfig, decode_token_columns
from .expand import ExpertLayout, LayoutKind
from .expert_gemm import takes_descriptor, weight_descriptor
from .launch import BoundLaunch, arrival_counters, interpreter_serialized
from .platform import interpreter_enabled
from .weights import ExpertWeights, WeightFormat

FP8_BLOCK = 128  # the one FP8 weight block the kernel reads: (128, 128), DeepSeek-V3's
MAX_TOKENS = 64  # up's MMA takes every token as a column


@triton.jit
def _row_block(b, ids, routed, rank, sorted_pair_ids_ptr, block_expert_ptr, num_pairs,
               PER_PAIR: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, pairs [BLOCK_M], real [BLOCK_M]) of row block b among those in use."""
    slots = tl.arange(0, BLOCK_M)
    if PER_PAIR:  # block b: the b-th routed pair, alone in its first row
        pick = routed & (rank == b)
        pair = tl.sum(tl.where(pick, tl.arange(0, P_PAD), 0))
        expert = tl.sum(tl.where(pick, ids, 0))
        pairs = tl.where(slots == 0, pair, num_pairs)
    else:
        pairs = tl.load(sorted_pair_ids_ptr + b * BLOCK_M + slots)
        expert = tl.load(block_expert_ptr + b)
    return expert.to(tl.int64), pairs, pairs < num_pairs


@triton.jit
def _routed_slots(tokens, real, topk_ids_ptr, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """[BLOCK_M] how many of each token's K slots hold an id in [0, E)."""
    k = tl.arange(0, K_PAD)
    ids = tl.load(topk_ids_ptr + tokens[:, None] * TOP_K + k[None, :],
                  mask=real[:, None] & (k[None, :] < TOP_K), other=-1)
    return tl.sum(((ids >= 0) & (ids < E)).to(tl.int32), axis=1)


@interpreter_serialized
@triton.jit
def _decode_layer_kernel(
    x_ptr, x_desc, w13_ptr, w13_desc, w2_ptr, w2_desc, w13_scale_ptr, w2_scale_ptr,
    topk_ids_ptr, topk_weights_ptr, sorted_pair_ids_ptr, block_expert_ptr, num_rows_ptr,
    h_ptr, h_desc, y_ptr, arrivals_ptr, barrier_ptr, out_ptr,
    T, H, I, E, num_pairs, w13_rows_per_expert, w13_scale_up_offset,
    stride_x_t, stride_w13_e, stride_w13_n, stride_w2_e, stride_w2_h,
    stride_tw_t, stride_tw_k, stride_out_t,
    stride_s13_e, stride_s13_n, stride_s13_c, stride_s2_e, stride_s2_h, stride_s2_c,
    PHASES: tl.constexpr,  # 1: up; 2: down and the sum; 3: both, a grid barrier between
    PER_PAIR: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,  # e4m3 weights in (FP8_BLOCK, FP8_BLOCK) blocks, dequantized per tile
    W_DESC: tl.constexpr,  # weights through TMA descriptors over (E * N, C) views
    A_DESC: tl.constexpr,  # x and h through TMA descriptors too (the pipeliner's async copies)
    IEEE_FP32: tl.constexpr, ACT_KIND: tl.constexpr, ACT_LIMIT: tl.constexpr,
    ACT_ALPHA: tl.constexpr, FP8_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,  # T <= BLOCK_T: every token a column of up's MMA
    BLOCK_I: tl.constexpr,  # down's contraction step
    H_SCALES: tl.constexpr, I_SCALES: tl.constexpr,  # FP8: scale blocks along H, I (padded)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    ids = tl.load(topk_ids_ptr + tl.arange(0, P_PAD), mask=tl.arange(0, P_PAD) < num_pairs,
                  other=-1)  # PER_PAIR's routing, [P_PAD]
    routed = (ids >= 0) & (ids < E)
    rank = tl.cumsum(routed.to(tl.int32), 0) - 1
    if PER_PAIR:
        num_blocks = tl.sum(routed.to(tl.int32))
    else:
        num_blocks = tl.load(num_rows_ptr) // BLOCK_M
    col_blocks = tl.cdiv(I, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_h = tl.arange(0, BLOCK_H)
    offs_m = tl.arange(0, BLOCK_M)
    offs_t = tl.arange(0, BLOCK_T)

    if PHASES % 2 == 1:  # ---- up: a unit's act(x W13^T) columns over all of H ----
        for unit in range(pid, num_blocks * col_blocks, programs):
            j = unit % col_blocks
            b = unit // col_blocks
            expert, pairs, real = _row_block(b, ids, routed, rank, sorted_pair_ids_ptr,
                                             block_expert_ptr, num_pairs, PER_PAIR, P_PAD,
                                             BLOCK_M)
            # the MMA's 16 columns are all T tokens, so x's tiles are one block whatever the
            # unit; a block row r takes the column of its token
            rows = j * BLOCK_N + offs_n
            w13_row = (expert * w13_rows_per_expert + j * BLOCK_N).to(tl.int32)
            w_gate = w13_ptr + expert * stride_w13_e + rows[:, None].to(tl.int64) * stride_w13_n
            s13 = (w13_scale_ptr + expert * stride_s13_e
                   + (j * BLOCK_N // FP8_BLOCK) * stride_s13_n)
            if FP8:  # the row block's scales, picked per step in registers (no load in the loop)
                offs_s = tl.arange(0, H_SCALES)
                gate_scales = tl.load(s13 + offs_s * stride_s13_c,
                                      mask=offs_s < tl.cdiv(H, FP8_BLOCK), other=0.0)
                up_scales = tl.load(s13 + w13_scale_up_offset * stride_s13_n
                                    + offs_s * stride_s13_c,
                                    mask=GATED & (offs_s < tl.cdiv(H, FP8_BLOCK)), other=0.0)
            acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            for c_first in range(0, H, BLOCK_C):
                cols = c_first + offs_c
                if A_DESC:
                    x = x_desc.load([0, c_first]).T  # rows past T: the copy's zeros
                else:
                    x = tl.load(x_ptr + offs_t[None, :] * stride_x_t + cols[:, None],
                                mask=(offs_t[None, :] < T) & (cols[:, None] < H),
                                other=0.0)  # [BLOCK_C, BLOCK_T]
                w_mask = (rows[:, None] < I) & (cols[None, :] < H)
                if W_DESC:
                    w = w13_desc.load([w13_row, c_first])
                else:
                    w = tl.load(w_gate + cols[None, :], mask=w_mask, other=0.0)
                if FP8:
                    block = c_first // FP8_BLOCK
                    acc += tl.dot(w.to(dtype), x) * tl.sum(tl.where(offs_s == block, gate_scales,
                                                                    0.0))
                else:
                    acc = _dot(w, x, acc, IEEE_FP32)
                if GATED:
                    if W_DESC:
                        w_up = w13_desc.load([w13_row + I, c_first])
                    else:
                        w_up = tl.load(w_gate + I * stride_w13_n + cols[None, :], mask=w_mask,
                                       other=0.0)
                    if FP8:
                        acc_up += tl.dot(w_up.to(dtype), x) * tl.sum(
                            tl.where(offs_s == block, up_scales, 0.0))
                    else:
                        acc_up = _dot(w_up, x, acc_up, IEEE_FP32)
            # token column t -> the block row holding its pair (a token has at most one pair
            # with an expert); columns of tokens not in the block, and rows past I (a tile's
            # overrun into the up half or the next expert), are never stored
            holds = ((pairs // TOP_K)[None, :] == offs_t[:, None]) & real[None, :]  # [T, M]
            block_row = b * BLOCK_M + tl.sum(tl.where(holds, offs_m[None, :], 0), axis=1)
            kept = (tl.sum(holds.to(tl.int32), axis=1) > 0)[None, :] & (rows[:, None] < I)
            h_tile = h_ptr + block_row[None, :].to(tl.int64) * I + rows[:, None]  # [N, T]
            tl.store(h_tile, _apply_activation(acc, acc_up, ACT_KIND, ACT_LIMIT, ACT_ALPHA)
                     .to(h_ptr.dtype.element_ty), mask=kept)

    if PHASES == 3:  # ---- every program's h stored before any is read ----
        tl.debug_barrier()  # this program's threads' stores precede its arrival (release)
        generation = tl.atomic_add(barrier_ptr + 1, 0)  # read before arriving
        arrived = tl.atomic_add(barrier_ptr, 1)
        if arrived == programs - 1:  # the last: reset the count, then open the barrier
            tl.atomic_xchg(barrier_ptr, 0)
            tl.atomic_add(barrier_ptr + 1, 1)
        else:
            seen = generation
            while seen == generation:
                seen = tl.atomic_add(barrier_ptr + 1, 0)
        tl.debug_barrier()

    if PHASES >= 2:  # ---- down: a unit's output columns over all of I, then the token sums ----
        for t in range(pid, T, programs):  # a token with no routed slot gets zeros
            if tl.sum(_routed_slots(tl.full([1], t, tl.int64), tl.full([1], 1, tl.int1),
                                    topk_ids_ptr, E, TOP_K, K_PAD)) == 0:
                for h_first in range(0, H, BLOCK_H):
                    tl.store(out_ptr + t * stride_out_t + h_first + offs_h,
                             tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty),
                             mask=h_first + offs_h < H)
        row_blocks = tl.cdiv(H, BLOCK_H)
        for out_unit in range(pid, num_blocks * row_blocks, programs):
            hb = out_unit % row_blocks
            expert, pairs, real = _row_block(out_unit // row_blocks, ids, routed, rank,
                                             sorted_pair_ids_ptr, block_expert_ptr, num_pairs,
                                             PER_PAIR, P_PAD, BLOCK_M)
            out_rows = hb * BLOCK_H + offs_h
            h_ok = out_rows < H
            w2_row = (expert * H + hb * BLOCK_H).to(tl.int32)
            w_down = (w2_ptr + expert * stride_w2_e
                      + out_rows[:, None].to(tl.int64) * stride_w2_h)
            s2 = w2_scale_ptr + expert * stride_s2_e + (hb * BLOCK_H // FP8_BLOCK) * stride_s2_h
            # h by block row: the block's tile is contiguous; rows of no pair are garbage and
            # only reach output columns never stored
            h_row = out_unit // row_blocks * BLOCK_M
            h_rows = h_ptr + (h_row + offs_m)[None, :].to(tl.int64) * I
            if FP8:
                offs_s = tl.arange(0, I_SCALES)
                down_scales = tl.load(s2 + offs_s * stride_s2_c,
                                      mask=offs_s < tl.cdiv(I, FP8_BLOCK), other=0.0)
            out_acc = tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32)
            offs_i = tl.arange(0, BLOCK_I)
            for i_first in range(0, I, BLOCK_I):  # the contraction over all of I
                i_cols = i_first + offs_i
                if A_DESC:
                    h = h_desc.load([h_row, i_first]).T  # [BLOCK_I, BLOCK_M]
                else:
                    h = tl.load(h_rows + i_cols[:, None], mask=i_cols[:, None] < I, other=0.0)
                if W_DESC:
                    w = w2_desc.load([w2_row, i_first])
                else:
                    w = tl.load(w_down + i_cols[None, :],
                                mask=h_ok[:, None] & (i_cols[None, :] < I), other=0.0)
                if FP8:
                    out_acc += tl.dot(w.to(dtype), h) * tl.sum(
                        tl.where(offs_s == i_first // FP8_BLOCK, down_scales, 0.0))
                else:
                    out_acc = _dot(w, h, out_acc, IEEE_FP32)
            tl.store(y_ptr + pairs[None, :].to(tl.int64) * H + out_rows[:, None], out_acc,
                     mask=real[None, :] & h_ok[:, None])
            tl.debug_barrier()  # the tile's stores precede the arrivals (release)
            tokens = (pairs // TOP_K).to(tl.int64)
            counters = arrivals_ptr + tokens * row_blocks + hb
            reached = tl.atomic_add(counters, 1, mask=real)
            last = real & (reached == _routed_slots(tokens, real, topk_ids_ptr, E, TOP_K,
                                                    K_PAD) - 1)
            if tl.max(last.to(tl.int32), axis=0) > 0:  # the token's other pairs are stored
                tl.debug_barrier()
                total = tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32)
                for slot in tl.static_range(TOP_K):  # slot order: bit-stable
                    pair = tokens * TOP_K + slot
                    slot_id = tl.load(topk_ids_ptr + pair, mask=last, other=-1)
                    used = last & (slot_id >= 0) & (slot_id < E)
                    weight = tl.load(topk_weights_ptr + tokens * stride_tw_t
                                     + slot * stride_tw_k, mask=used, other=0.0)
                    y = tl.load(y_ptr + pair[None, :] * H + out_rows[:, None],
                                mask=used[None, :] & h_ok[:, None], other=0.0,
                                cache_modifier=".cg")
                    total += y * weight.to(tl.float32)[None, :]
                tl.store(out_ptr + tokens[None, :] * stride_out_t + out_rows[:, None],
                         total.to(out_ptr.dtype.element_ty), mask=last[None, :] & h_ok[:, None])
                tl.atomic_xchg(counters, 0, mask=last)  # ready for the next call


def decode_supports(fmt: WeightFormat) -> bool:
    """Formats the kernel reads: unquantized, or FP8 in (128, 128) blocks with dynamic activations
    (plan_decode_layer refuses the others, naming config.decode)."""
    return not fmt.fp4 and (fmt.fp8 is None
                            or (fmt.block == (FP8_BLOCK, FP8_BLOCK) and not fmt.static_input))


@dataclass(frozen=True)
class DecodePlan:
    """`decode_layer` for one signature: its launches (one, or the interpreter's two phases) and
    the scratch they share: h by block row [B * block_m, I], pair rows [P, H] float32, and int32
    counters, zero between calls: an arrival count per token and output block, the grid
    barrier's count and generation."""

    out_shape: tuple[int, int]  # [T, H]
    config: DecodeConfig
    descriptors: bool  # weights through TMA descriptors
    launches: tuple[BoundLaunch, ...]  # (): no tokens, no output or no intermediate columns
    scratch: dict[str, torch.Tensor] | None = None  # the kernel's pointer arguments
    block_t: int = 16  # x's tile rows: every token
    h_desc: TensorDescriptor | None = None  # with x's: the activations through TMA too

    @property
    def holds_scratch(self) -> bool:  # PlanCache keeps it: a graph may write the scratch
        return self.scratch is not None

    def __call__(self, x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                 topk_weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)  # [T, H]
        if not self.launches:
            return out.zero_() if out.numel() else out
        w13, w2 = weights.w13, weights.w2
        c = self.config
        descriptors = ((weight_descriptor(w13, (c.block_n, c.block_c)),
                        weight_descriptor(w2, (c.block_h, c.block_i)))
                       if self.descriptors else (w13, w2))
        # x's descriptor is new each call (the launcher encodes it each time); h's is the plan's.
        # A copy starts at a 16-byte boundary, as TMA needs; a view into a tensor may not.
        if self.h_desc is not None and x.data_ptr() % 16:
            x = x.clone()
        x_desc = (TensorDescriptor(x, list(x.shape), list(x.stride()), [self.block_t, c.block_c])
                  if self.h_desc is not None else x)
        sorted_pair_ids, block_expert, num_rows = layout.block_tensors()
        scales = ((weights.w13_scale, weights.w2_scale) if weights.format.fp8 is not None
                  else (out, out))
        for launch in self.launches:
            launch(x_ptr=x, x_desc=x_desc, w13_ptr=w13, w13_desc=descriptors[0], w2_ptr=w2,
                   w2_desc=descriptors[1], w13_scale_ptr=scales[0], w2_scale_ptr=scales[1],
                   topk_ids_ptr=layout.topk_ids, topk_weights_ptr=topk_weights,
                   sorted_pair_ids_ptr=sorted_pair_ids, block_expert_ptr=block_expert,
                   num_rows_ptr=num_rows, out_ptr=out, h_desc=self.h_desc or self.scratch["h_ptr"],
                   **self.scratch)
        return out


def plan_decode_layer(x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                      topk_weights: torch.Tensor, config: DecodeConfig, activation: Activation,
                      out: torch.Tensor | None = None,
                      one_launch: bool | None = None) -> DecodePlan:
    """one_launch: both phases in one cooperative launch (default: on a GPU, not the
    interpreter, whose barrier would never open), else two launches."""
    if config.block_m != layout.block_m:
        raise ValueError(f"config.block_m={config.block_m} must equal the layout's "
                         f"block_m={layout.block_m}")
    if not decode_supports(weights.format) or weights.biased:
        raise ValueError(f"config.decode: the decode kernel reads unbiased, unquantized or FP8 "
                         f"block-{FP8_BLOCK} weights with dynamic activations, not "
                         f"{weights.format}{' with biases' if weights.biased else ''}; pass a "
                         "config without decode (choose_config's)")
    if x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"config.decode: the decode kernel reads hidden_states rows of unit "
                         f"stride, got strides {tuple(x.stride())}; pass "
                         "hidden_states.contiguous() or a config without decode")
    fp8 = weights.format.fp8 is not None
    if fp8 and (FP8_BLOCK % config.block_c or FP8_BLOCK % config.block_n
                or FP8_BLOCK % config.block_h or FP8_BLOCK % config.block_i):
        raise ValueError(f"config.decode: FP8 tiles lie within one {FP8_BLOCK}-wide weight block "
                         f"(block_c, block_n, block_h and block_i dividing {FP8_BLOCK}), got "
                         f"{config}; decode_config's tiles do")
    T, K = topk_weights.shape
    if T > MAX_TOKENS:
        raise ValueError(f"config.decode: the decode kernel runs at most {MAX_TOKENS} tokens "
                         f"(every token a column of its MMA), got {T}; pass a config without "
                         "decode (choose_config's)")
    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    w13, w2 = weights.w13, weights.w2
    P = T * K
    descriptors = config.tma_weights and takes_descriptor(w13) and takes_descriptor(w2)
    if T == 0 or H == 0 or I == 0:  # nothing to launch (no intermediate columns: zeros)
        return DecodePlan((T, H), config, descriptors, ())
    device = x.device
    per_pair = layout.kind is LayoutKind.PER_PAIR
    max_blocks = P if per_pair else layout.max_rows // layout.block_m
    out_counts = T * triton.cdiv(H, config.block_h)
    counters = arrival_counters(4 + out_counts, device)  # arrivals 16 bytes in: aligned
    rows = max_blocks * layout.block_m  # up's outputs by block row
    h = torch.empty(rows, I, dtype=x.dtype if fp8 else w13.dtype, device=device)
    # x's rows 16-byte multiples (its start is checked at each call, h's is a fresh tensor's)
    activation_descriptors = (descriptors and takes_descriptor(h) and x.stride(1) == 1
                              and (x.stride(0) * x.element_size()) % 16 == 0)
    block_t = decode_token_columns(T)
    h_desc = (TensorDescriptor.from_tensor(h, [config.block_m, config.block_i])
              if activation_descriptors else None)
    scratch = dict(h_ptr=h,
                   y_ptr=torch.empty(P, H, dtype=torch.float32, device=device),
                   barrier_ptr=counters[:2], arrivals_ptr=counters[4:])
    s13, s2 = ((weights.w13_scale.stride(), weights.w2_scale.stride()) if fp8
               else ((0, 0, 0), (0, 0, 0)))
    out_stride = out.stride(0) if out is not None else H
    fixed = dict(
        T=T, H=H, I=I, E=E, num_pairs=P, w13_rows_per_expert=w13.shape[1],
        w13_scale_up_offset=weights.w13_scale_up_offset if fp8 else 0,
        stride_x_t=x.stride(0), stride_w13_e=w13.stride(0), stride_w13_n=w13.stride(1),
        stride_w2_e=w2.stride(0), stride_w2_h=w2.stride(1),
        stride_tw_t=topk_weights.stride(0), stride_tw_k=topk_weights.stride(1),
        stride_out_t=out_stride,
        stride_s13_e=s13[0], stride_s13_n=s13[1], stride_s13_c=s13[2],
        stride_s2_e=s2[0], stride_s2_h=s2[1], stride_s2_c=s2[2],
        PER_PAIR=per_pair, TOP_K=K, K_PAD=triton.next_power_of_2(K),
        P_PAD=triton.next_power_of_2(P) if per_pair else 16, GATED=weights.gated, FP8=fp8,
        W_DESC=descriptors, A_DESC=activation_descriptors,
        IEEE_FP32=w13.dtype == torch.float32, FP8_BLOCK=FP8_BLOCK,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_C=config.block_c,
        BLOCK_H=config.block_h, BLOCK_T=block_t, BLOCK_I=config.block_i,
        H_SCALES=triton.next_power_of_2(triton.cdiv(H, FP8_BLOCK)),
        I_SCALES=triton.next_power_of_2(triton.cdiv(I, FP8_BLOCK)),
        **activation.kernel_args(),
    )
    grid = (config.programs,)
    options = config.launch_options()
    if one_launch is None:
        one_launch = not interpreter_enabled()
    if not one_launch:
        launches = tuple(BoundLaunch(_decode_layer_kernel, grid, {**fixed, "PHASES": phase},
                                     options) for phase in (1, 2))
    else:
        launches = (BoundLaunch(_decode_layer_kernel, grid, {**fixed, "PHASES": 3},
                                {**options, "launch_cooperative_grid": True}),)
    return DecodePlan((T, H), config, descriptors, launches, scratch, block_t, h_desc)


def decode_layer(x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                 topk_weights: torch.Tensor, config: DecodeConfig,
                 activation: Activation) -> torch.Tensor:
    """x (T, H) -> (T, H) in x's dtype: the expert layer for `layout`'s routing."""
    plan = plan_decode_layer(x, weights, layout, topk_weights, config, activation)
    return plan(x, weights, layout, topk_weights)


def decode_layer_torch(x: torch.Tensor, weights: ExpertWeights, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Reference: float32 on the dequantized weights, pair by pair; filtered slots add nothing."""
    T, K = topk_ids.shape
    E = weights.num_experts
    w13, w2 = weights.dequantized()  # [E, 2I, H], [E, H, I] float32
    out = torch.zeros(T, weights.hidden_size, device=x.device)
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        if 0 <= e < E:
            h = activation_torch(x[p // K].float() @ w13[e].T, activation)  # [I]
            out[p // K] += topk_weights[p // K, p % K].float() * (h @ w2[e].T)
    return out
