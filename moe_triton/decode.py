"""Stages 3-4 at decode (a few tokens): both expert GEMMs in one kernel, sliced along I.

    y[s, p, :] = act(x[t] @ w13[e][slice s].T) @ w2[e][:, slice s].T    pair p = t * K + k, expert e

Program (b, s) computes intermediate slice s (BLOCK_N columns, gate and up) of row block b over the
whole H contraction, applies the activation in registers, and multiplies it by w2's matching
columns for every output column: the sum over slices is the second GEMM's contraction, left to
finalize as float32 partials by pair (summed in a fixed order: bit-stable, no atomics). The
[R, I] intermediate never reaches memory, one launch replaces up + down (and FP8's quantize), and
the slices spread one token's K experts over every SM. FP8 block-scaled weights: x quantized per
128-column group (by each program, or by the quantize stage before it: DecodeConfig's
quantize_input), the intermediate slice per row, each e4m3 product scaled once per step. finalize
launches as a programmatic dependent (PDL) of this kernel on SM90+: its launch overlaps this
kernel's tail.

Opt-in (config.decode_config): on the H200 it measured no faster than the two GEMMs, whose
intermediate is tiny at decode while these partials are not (docs/PERFORMANCE.md, issue 28).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._expert_gemm_kernels import _dot, _e4m3_nan, _step
from .activation import Activation, _apply_activation, activation_torch
from .config import DecodeConfig
from .expand import ExpertLayout, LayoutKind
from .expert_gemm import takes_descriptor, weight_descriptor
from .launch import BoundLaunch, interpreter_serialized
from .platform import gdc_launch_dependents, interpreter_enabled
from .quantize import quantize_rows
from .weights import ExpertWeights, WeightFormat

FP8_BLOCK = 128  # the one FP8 weight block the kernel reads: (128, 128), DeepSeek-V3's


@interpreter_serialized
@triton.jit
def _decode_experts_kernel(
    x_ptr, w13_ptr, w13_desc, w2_ptr, w2_desc, y_ptr,
    sorted_pair_ids_ptr, block_expert_ptr, num_rows_ptr, topk_ids_ptr, x_scale_ptr,
    w13_scale_ptr, w2_scale_ptr,
    H, I, E, num_pairs, w13_rows_per_expert, w13_scale_up_offset,
    stride_x_t, stride_xs_t, stride_w13_e, stride_w13_n, stride_w13_c,
    stride_w2_e, stride_w2_h, stride_w2_c,
    stride_y_s, stride_y_p,
    stride_s13_e, stride_s13_n, stride_s13_c, stride_s2_e, stride_s2_h, stride_s2_c,
    PER_PAIR: tl.constexpr,  # row block b holds pair b in its first row; its expert is topk_ids[b]
    TOP_K: tl.constexpr, GATED: tl.constexpr,
    FP8: tl.constexpr,  # e4m3 weights in (FP8_BLOCK, FP8_BLOCK) blocks; BLOCK_C == FP8_BLOCK
    X_QUANTIZED: tl.constexpr,  # FP8: x is e4m3 already, a scale per (token, FP8_BLOCK columns)
    NAN_BITS: tl.constexpr,  # FP8, interpreted: the products' NaN from the e4m3 bits
    W_DESC: tl.constexpr,  # weights through TMA descriptors over (E * N, C) views
    PDL: tl.constexpr,  # let finalize launch now (it waits for this grid before reading y)
    ACT_KIND: tl.constexpr, ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr,
    IEEE_FP32: tl.constexpr, FP8_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PER_PAIR:
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        expert = tl.load(topk_ids_ptr + pid_m).to(tl.int64)
    else:
        # The grid covers the worst case; blocks past the rows in use exit at once.
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
        pair = tl.load(sorted_pair_ids_ptr + rows)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= E):  # a filtered pair (PER_PAIR) or an unused block
        return
    is_real = pair < num_pairs
    tokens = (pair // TOP_K).to(tl.int64)
    offs_n = pid_s * BLOCK_N + tl.arange(0, BLOCK_N)  # this slice's intermediate columns
    n_ok = offs_n < I
    offs_c = tl.arange(0, BLOCK_C)

    # ---- the first GEMM: the slice's gate and up columns over all of H ----
    x_tile = x_ptr + tokens[:, None] * stride_x_t + offs_c[None, :]
    w_gate = (w13_ptr + expert * stride_w13_e + offs_n[None, :].to(tl.int64) * stride_w13_n
              + offs_c[:, None] * stride_w13_c)  # [BLOCK_C, BLOCK_N]
    up_offset = I * stride_w13_n
    w13_row = (expert * w13_rows_per_expert + pid_s * BLOCK_N).to(tl.int32)
    s13 = w13_scale_ptr + expert * stride_s13_e + (pid_s * BLOCK_N // FP8_BLOCK) * stride_s13_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nan_rows = tl.zeros([BLOCK_M], dtype=tl.int32)  # NAN_BITS: rows of x / columns of w with NaN
    nan_cols = tl.zeros([BLOCK_N], dtype=tl.int32)
    nan_cols_up = tl.zeros([BLOCK_N], dtype=tl.int32)
    for step in range(0, tl.cdiv(H, BLOCK_C)):
        c_first = step * BLOCK_C
        c_ok = offs_c < H - c_first
        w_mask = c_ok[:, None] & n_ok[None, :]
        x = tl.load(x_tile, mask=is_real[:, None] & c_ok[None, :], other=0.0)
        x_scale = 0.0
        if FP8:
            if X_QUANTIZED:
                x_scale = tl.load(x_scale_ptr + tokens * stride_xs_t + step, mask=is_real,
                                  other=0.0)  # [BLOCK_M]
            else:  # x's 128-column group, quantized here as quantize.py does it
                x, x_scale = quantize_rows(x.to(tl.float32))  # [BLOCK_M, BLOCK_C], [BLOCK_M]
        if W_DESC:
            w = w13_desc.load([w13_row, c_first]).T
        else:
            w = tl.load(w_gate, mask=w_mask, other=0.0)
        if FP8:
            scale = tl.load(s13 + (c_first // FP8_BLOCK) * stride_s13_c)
            acc = _step(x, w, acc, x_scale, scale, 1, 1, True, False)
        else:
            acc = _dot(x, w, acc, IEEE_FP32)
        if NAN_BITS:
            nan_rows = nan_rows | _e4m3_nan(x, 1)
            nan_cols = nan_cols | _e4m3_nan(w, 0)
        if GATED:
            if W_DESC:
                w_up = w13_desc.load([w13_row + I, c_first]).T
            else:
                w_up = tl.load(w_gate + up_offset, mask=w_mask, other=0.0)
            if FP8:
                scale_up = tl.load(s13 + w13_scale_up_offset * stride_s13_n
                                   + (c_first // FP8_BLOCK) * stride_s13_c)
                acc_up = _step(x, w_up, acc_up, x_scale, scale_up, 1, 1, True, False)
            else:
                acc_up = _dot(x, w_up, acc_up, IEEE_FP32)
            if NAN_BITS:
                nan_cols_up = nan_cols_up | _e4m3_nan(w_up, 0)
        x_tile += BLOCK_C
        w_gate += BLOCK_C * stride_w13_c
    if NAN_BITS:  # the interpreter's dot reads e4m3 NaN as 480: restore a GPU's NaN
        acc = tl.where((nan_rows[:, None] | nan_cols[None, :]) > 0, float("nan"), acc)
        acc_up = tl.where((nan_rows[:, None] | nan_cols_up[None, :]) > 0, float("nan"), acc_up)
    # Columns past I (a descriptor tile's overrun into the up half or the next expert) are
    # garbage: zero them, as w2's columns there are (a 0 * inf would be NaN).
    h = tl.where(n_ok[None, :], _apply_activation(acc, acc_up, ACT_KIND, ACT_LIMIT, ACT_ALPHA), 0.0)

    # ---- the second GEMM: the slice's share of every output column ----
    h_scale = 0.0
    if FP8:  # one scale per row of the slice: the groups the prefill up GEMM's epilogue makes
        a, h_scale = quantize_rows(h)  # [BLOCK_M, BLOCK_N], [BLOCK_M]
        if NAN_BITS:
            nan_rows = _e4m3_nan(a, 1)
    else:
        a = h.to(w2_ptr.dtype.element_ty)
    offs_h = tl.arange(0, BLOCK_H)
    w_down = (w2_ptr + expert * stride_w2_e + offs_h[None, :].to(tl.int64) * stride_w2_h
              + offs_n[:, None] * stride_w2_c)  # [BLOCK_N, BLOCK_H]
    s2 = w2_scale_ptr + expert * stride_s2_e + (pid_s * BLOCK_N // FP8_BLOCK) * stride_s2_c
    y_rows = y_ptr + pid_s * stride_y_s + pair[:, None].to(tl.int64) * stride_y_p
    w2_row = (expert * H).to(tl.int32)
    for chunk in range(0, tl.cdiv(H, BLOCK_H)):
        h_first = chunk * BLOCK_H
        h_ok = offs_h < H - h_first
        if W_DESC:
            w = w2_desc.load([w2_row + h_first, pid_s * BLOCK_N]).T
        else:
            w = tl.load(w_down, mask=n_ok[:, None] & h_ok[None, :], other=0.0)
        if FP8:
            scale = tl.load(s2 + (h_first // FP8_BLOCK) * stride_s2_h)
            part = tl.dot(a, w) * (h_scale * scale)[:, None]
            if NAN_BITS:
                part = tl.where((nan_rows[:, None] | _e4m3_nan(w, 0)[None, :]) > 0, float("nan"),
                                part)
        else:
            part = _dot(a, w, tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32), IEEE_FP32)
        tl.store(y_rows + (h_first + offs_h)[None, :], part, mask=is_real[:, None] & h_ok[None, :])
        w_down += BLOCK_H * stride_w2_h


def decode_supports(fmt: WeightFormat) -> bool:
    """Formats the kernel reads: unquantized, or FP8 in (128, 128) blocks with dynamic activations
    (plan_decode_experts refuses the others, naming config.decode)."""
    return fmt.fp8 is None or (fmt.block == (FP8_BLOCK, FP8_BLOCK) and not fmt.static_input)


@dataclass(frozen=True)
class DecodePlan:
    """`decode_experts` for one signature: y, float32 partials [S, P, H] by pair, S slices of I."""

    out_shape: tuple[int, int, int]  # [S, P, H]
    config: DecodeConfig
    descriptors: bool  # weights through TMA descriptors
    launch: BoundLaunch | None  # None: no pairs or no columns

    def __call__(self, x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                 x_scales: torch.Tensor | None = None, y: torch.Tensor | None = None):
        """x (T, H); with config.quantize_input off, FP8's e4m3 x and scales (T, H / 128);
        y: a contiguous float32 out_shape buffer (default fresh)."""
        if y is None:
            y = torch.empty(self.out_shape, dtype=torch.float32, device=x.device)  # [S, P, H]
        if self.launch is not None:
            w13, w2 = weights.w13, weights.w2
            c = self.config
            descriptors = ((weight_descriptor(w13, (c.block_n, c.block_c)),
                            weight_descriptor(w2, (c.block_h, c.block_n)))
                           if self.descriptors else (w13, w2))
            sorted_pair_ids, block_expert, num_rows = layout.block_tensors()
            scales = ((weights.w13_scale, weights.w2_scale) if weights.format.fp8 is not None
                      else (y, y))
            self.launch(x_ptr=x, w13_ptr=w13, w13_desc=descriptors[0], w2_ptr=w2,
                        w2_desc=descriptors[1], y_ptr=y, sorted_pair_ids_ptr=sorted_pair_ids,
                        block_expert_ptr=block_expert, num_rows_ptr=num_rows,
                        topk_ids_ptr=layout.topk_ids,
                        x_scale_ptr=x_scales if x_scales is not None else y,
                        w13_scale_ptr=scales[0], w2_scale_ptr=scales[1])
        return y


def plan_decode_experts(x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                        config: DecodeConfig, activation: Activation,
                        pdl: bool = False) -> DecodePlan:
    if config.block_m != layout.block_m:
        raise ValueError(f"config.block_m={config.block_m} must equal the layout's "
                         f"block_m={layout.block_m}")
    if not decode_supports(weights.format):
        raise ValueError(f"config.decode: the decode kernel reads unquantized or FP8 "
                         f"block-{FP8_BLOCK} weights with dynamic activations, not "
                         f"{weights.format}; pass a config without decode (choose_config's)")
    if x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"config.decode: the decode kernel reads hidden_states rows of unit "
                         f"stride, got strides {tuple(x.stride())}; pass "
                         "hidden_states.contiguous() or a config without decode")
    fp8 = weights.format.fp8 is not None
    if fp8 and (config.block_c != FP8_BLOCK or FP8_BLOCK % config.block_n
                or FP8_BLOCK % config.block_h):
        raise ValueError(f"config.decode: FP8 steps a whole {FP8_BLOCK}-wide block "
                         f"(block_c={FP8_BLOCK}) with block_n and block_h dividing it, got "
                         f"{config}; decode_config's tiles do")
    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    w13, w2 = weights.w13, weights.w2
    S, P = triton.cdiv(I, config.block_n), layout.num_pairs
    descriptors = config.tma_weights and takes_descriptor(w13) and takes_descriptor(w2)
    num_m_blocks = layout.max_rows // layout.block_m
    if num_m_blocks == 0 or H == 0 or I == 0:
        return DecodePlan((S, P, H), config, descriptors, None)
    s13, s2 = ((weights.w13_scale.stride(), weights.w2_scale.stride()) if fp8
               else ((0, 0, 0), (0, 0, 0)))
    fixed = dict(
        H=H, I=I, E=E, num_pairs=P, w13_rows_per_expert=w13.shape[1],
        w13_scale_up_offset=weights.w13_scale_up_offset if fp8 else 0,
        stride_x_t=x.stride(0), stride_xs_t=triton.cdiv(H, FP8_BLOCK),
        stride_w13_e=w13.stride(0), stride_w13_n=w13.stride(1),
        stride_w13_c=w13.stride(2), stride_w2_e=w2.stride(0), stride_w2_h=w2.stride(1),
        stride_w2_c=w2.stride(2), stride_y_s=P * H, stride_y_p=H,
        stride_s13_e=s13[0], stride_s13_n=s13[1], stride_s13_c=s13[2],
        stride_s2_e=s2[0], stride_s2_h=s2[1], stride_s2_c=s2[2],
        PER_PAIR=layout.kind is LayoutKind.PER_PAIR, TOP_K=layout.top_k, GATED=weights.gated,
        FP8=fp8, X_QUANTIZED=fp8 and not config.quantize_input,
        NAN_BITS=fp8 and interpreter_enabled(), W_DESC=descriptors, PDL=pdl,
        IEEE_FP32=w13.dtype == torch.float32, FP8_BLOCK=FP8_BLOCK,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_C=config.block_c,
        BLOCK_H=config.block_h, **activation.kernel_args(),
    )
    launch = BoundLaunch(_decode_experts_kernel, (num_m_blocks, S), fixed,
                         config.launch_options())
    return DecodePlan((S, P, H), config, descriptors, launch)


def decode_experts(x: torch.Tensor, weights: ExpertWeights, layout: ExpertLayout,
                   config: DecodeConfig, activation: Activation) -> torch.Tensor:
    """x (T, H) -> float32 partials (S, P, H): pair p's output from intermediate slice s (zero
    rows are never written: a filtered pair's row is garbage; finalize skips it)."""
    return plan_decode_experts(x, weights, layout, config, activation)(x, weights, layout)


def decode_experts_torch(x: torch.Tensor, weights: ExpertWeights, topk_ids: torch.Tensor,
                         block_n: int, activation: Activation) -> torch.Tensor:
    """Reference: float32 (S, P, H) partials on the dequantized weights; filtered pairs zero."""
    T, K = topk_ids.shape
    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    w13, w2 = weights.dequantized()  # [E, 2I, H], [E, H, I] float32
    S = -(-I // block_n)
    y = torch.zeros(S, T * K, H, device=x.device)  # [S, P, H]
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        if not 0 <= e < E:
            continue
        h = activation_torch(x[p // K].float() @ w13[e].T, activation)  # [I]
        for s in range(S):
            cols = slice(s * block_n, (s + 1) * block_n)
            y[s, p] = h[cols] @ w2[e][:, cols].T  # [H]
    return y
