"""Decode-size projections: x (T, C) @ w (N, C).T (+ bias) -> (T, N), T <= 64.

A decode step's dense projections (attention's qkv and o, the router, shared experts) read each
weight once for a handful of rows: the work is the weight stream, 0.5-21 MB a projection, 1-5 µs
of bytes, and a kernel's ramp (the first bytes ~2 µs after launch) costs as much as its bytes
(docs/PERFORMANCE.md, issue 30). So a program (column block, slice of C) starts on its weights
before it waits for the kernel in front (programmatic dependent launch, `prefetch_weight`): the
weights stream while that kernel (the norm, the attention) still runs, which must let its
dependents launch early (platform.wait_then_release), and the grid is sized so that every
program is resident at launch. One row (batch-1 decode) goes by FMAs into a float32 tile summed
across C once, at the end, its first weight tile loaded before the wait; more rows (padded to
16, 32 or 64) through the tensor cores in a loop the compiler pipelines, the slice's weight lines
requested into L2 before the wait. With more than one slice each program stores its float32
partial sums, and the last program of a column block to finish (a counter it bumps with
acquire-release ordering) adds the slices in slice order and writes the output: no second
launch, and the bits do not depend on which program finished last. The counters return to zero
after each call, so a plan can be replayed in a CUDA graph; a plan's calls must not overlap in
time (one stream). `gemv_torch`: the reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import checks
from ._expert_gemm_kernels import _dot
from .expert_gemm import ScaleAlongC
from .launch import BoundLaunch, PlanCache, arrival_counters, interpreter_serialized
from .platform import dependent_launch, device_limits, prefetch_to_l2, wait_then_release
from .weights import FP8_DTYPE, Fp8Scaling, WeightFormat, dequantize_weight, tensor_signature

MAX_ROWS = 64  # decode batches up to it: one tensor-core row tile (wgmma's M)
L2_LINE_BYTES = 128


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32  # output columns per program
    block_c: int = 128  # contraction step: one weight tile a load
    slices: int = 1  # programs along C per column block (> 1: partials summed by the last)
    num_warps: int = 8
    num_stages: int = 1  # 1: the kernel keeps only its next weight tile in flight itself
    tensor_cores: bool = False  # a 16-row tile through tl.dot; False: one row (T = 1) by FMAs


PROGRAMS_PER_SM = 4  # one row's programs resident at once (8 warps each): all prefetch at launch
# More rows: the tensor-core tile beats cuBLAS at the router (0.5 MB), not at a shared expert's up
# (6 MB), o or qkv (17-21 MB): docs/PERFORMANCE.md, issue 30, tenth session
ROWS_WEIGHT_BYTES = 2 << 20


def choose_gemv_config(T: int, N: int, C: int, num_sms: int,
                       scale_block_c: int | None = None) -> GemvConfig:
    """One row by FMAs, 32 x 128 tiles, slices the largest power of two that keeps the grid within
    PROGRAMS_PER_SM programs an SM, each slice at least two steps (measured best at a Qwen3
    step's qkv, o and router projections behind a norm, bf16 and FP8: docs/PERFORMANCE.md, issue
    30; docs/sweep-gemv-2026-12-03.txt, -fp8-, -stages-). More rows through the tensor cores:
    TENSOR_CORE_TILE, as many slices as keep the grid within TENSOR_CORE_PROGRAMS_PER_SM an SM,
    each at least two steps, spread evenly (no empty slice). FP8 block scales `scale_block_c`
    columns wide: steps that divide them (one scale a row a step)."""
    one_row = T == 1
    config = GemvConfig() if one_row else TENSOR_CORE_TILE
    if scale_block_c is not None:
        config = replace(config, block_c=math.gcd(config.block_c, scale_block_c))
    per_sm = PROGRAMS_PER_SM if one_row else TENSOR_CORE_PROGRAMS_PER_SM
    steps = triton.cdiv(C, config.block_c)
    wanted = min(max(1, steps // 2), triton.cdiv(per_sm * num_sms, triton.cdiv(N, config.block_n)))
    if one_row:
        return replace(config, slices=1 << (wanted.bit_length() - 1))
    return replace(config, slices=triton.cdiv(steps, triton.cdiv(steps, wanted)))


# 2-64 rows: a pipelined 32 x 128 tile, weights in L2 before the wait (chained)
TENSOR_CORE_TILE = GemvConfig(block_n=32, block_c=128, num_warps=4, num_stages=4,
                              tensor_cores=True)
TENSOR_CORE_PROGRAMS_PER_SM = 2


@interpreter_serialized
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    T, N, C, stride_x_t, stride_w_n, stride_s_n, stride_out_t,
    SLICES: tl.constexpr, IEEE_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
    # FP8 w's float32 scales, an expert_gemm.ScaleAlongC: PER_STEP (1) one a SCALE_N x SCALE_C
    # block (SCALE_C a multiple of BLOCK_C), on each step's tile; PER_SUM (2) one an output row
    # (stride 0: one for the tensor), on the sums
    SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_C: tl.constexpr,
    CHAINED: tl.constexpr,  # chained (PDL): w read before the kernel in front ends, x after
    DOT: tl.constexpr,  # tensor cores (BLOCK_T >= 16); else one row by FMAs (BLOCK_T == 1)
    LINE_ELEMENTS: tl.constexpr,  # w's elements an L2 line (DOT, chained: the prefetch's step)
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(C, BLOCK_C)
    per_slice = tl.cdiv(steps, SLICES)
    first, end = pid_s * per_slice, tl.minimum((pid_s + 1) * per_slice, steps)
    c_end = tl.minimum(end * BLOCK_C, C)  # this slice's end along C
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w_n  # [BLOCK_N, 1]
    if DOT:
        acc = _tensor_core_slice(x_ptr, w_ptr, scale_ptr, rows, cols, first, end, T, N, C,
                                 stride_x_t, stride_w_n, stride_s_n, IEEE_FP32, SCALE, SCALE_N,
                                 SCALE_C, CHAINED, LINE_ELEMENTS, BLOCK_T, BLOCK_N, BLOCK_C)
    else:
        acc = _one_row_slice(x_ptr, w_rows, scale_ptr, cols, first, end, c_end, N, C,
                             stride_s_n, SCALE, SCALE_N, SCALE_C, CHAINED, BLOCK_N, BLOCK_C)
    if SCALE == 2:
        acc *= tl.load(scale_ptr + cols * stride_s_n, mask=cols < N, other=0.0)[None, :]
    out_mask = (rows[:, None] < T) & (cols[None, :] < N)
    out = out_ptr + rows[:, None] * stride_out_t + cols[None, :]
    if SLICES == 1:
        tl.store(out, _with_bias(acc, bias_ptr, cols, N, HAS_BIAS).to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        tile = rows[:, None] * N + cols[None, :]  # [BLOCK_T, BLOCK_N] of a slice's (T, N)
        tl.store(partial_ptr + pid_s * T * N + tile, acc, mask=out_mask)
        # release: this slice's partials (every thread's: the barrier first) are visible before
        # the count; acquire: the last sees all, read past L1
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SLICES - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SLICES):  # slice order; unrolled, so the loads issue at once
                total += tl.load(partial_ptr + s * T * N + tile, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out, _with_bias(total, bias_ptr, cols, N, HAS_BIAS).to(
                out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call


@triton.jit
def _one_row_slice(x_ptr, w_rows, scale_ptr, cols, first, end, c_end, N, C, stride_s_n,
                   SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_C: tl.constexpr,
                   CHAINED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """[1, BLOCK_N] float32 sums of one row over steps [first, end), by FMAs into a [BLOCK_N,
    BLOCK_C] tile summed across C once, at the end. Double-buffered by hand: the first weight tile
    is issued before the wait, each next one while this one is summed."""
    cs = first * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.load(w_rows + cs[None, :], mask=(cols[:, None] < N) & (cs[None, :] < c_end),
                other=0.0)  # [BLOCK_N, BLOCK_C]: the first tile, issued before the wait
    if SCALE == 1:  # the tile's column of the block grid, one scale a row
        block_scale = tl.load(scale_ptr + (cols // SCALE_N) * stride_s_n
                              + first * BLOCK_C // SCALE_C,
                              mask=cols < tl.where(first < end, N, 0), other=0.0)
    wait_then_release(CHAINED)  # x (the kernel in front's output) complete from here on
    lanes = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for step in range(first, end):
        x = tl.load(x_ptr + cs, mask=cs < C, other=0.0)  # [BLOCK_C]
        w32 = w.to(tl.float32)
        if SCALE == 1:
            w32 = w32 * block_scale[:, None]
        lanes += w32 * x.to(tl.float32)[None, :]
        cs += BLOCK_C  # the next tile and its scales, in flight while this one is summed
        w = tl.load(w_rows + cs[None, :], mask=(cols[:, None] < N) & (cs[None, :] < c_end),
                    other=0.0)
        if SCALE == 1:
            block_scale = tl.load(scale_ptr + (cols // SCALE_N) * stride_s_n
                                  + (step + 1) * BLOCK_C // SCALE_C,
                                  mask=cols < tl.where(step + 1 < end, N, 0), other=0.0)
    return tl.sum(lanes, 1)[None, :]


@triton.jit
def _tensor_core_slice(x_ptr, w_ptr, scale_ptr, rows, cols, first, end, T, N, C, stride_x_t,
                       stride_w_n, stride_s_n, IEEE_FP32: tl.constexpr, SCALE: tl.constexpr,
                       SCALE_N: tl.constexpr, SCALE_C: tl.constexpr, CHAINED: tl.constexpr,
                       LINE_ELEMENTS: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """[BLOCK_T, BLOCK_N] float32 sums of up to BLOCK_T rows over steps [first, end), through
    the tensor cores, the loop pipelined by the compiler (the launch's num_stages). Chained, the
    slice's weight lines are first requested into L2 (`LINE_ELEMENTS` a line), so they stream
    while the kernel in front runs and the loop's loads after the wait find them there."""
    if CHAINED:
        lines = tl.arange(0, BLOCK_C // LINE_ELEMENTS) * LINE_ELEMENTS
        w_rows = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_w_n
        for step in range(first, end):
            prefetch_to_l2(w_rows + tl.minimum(step * BLOCK_C + lines, C - 1)[None, :])
    wait_then_release(CHAINED)  # x (the kernel in front's output) complete from here on
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    w_columns = w_ptr + cols[None, :].to(tl.int64) * stride_w_n  # [1, BLOCK_N]: w read as w.T
    for step in range(first, end):
        cs = step * BLOCK_C + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + rows[:, None] * stride_x_t + cs[None, :],
                    mask=(rows[:, None] < T) & (cs[None, :] < C), other=0.0)  # [BLOCK_T, BLOCK_C]
        w = tl.load(w_columns + cs[:, None], mask=(cols[None, :] < N) & (cs[:, None] < C),
                    other=0.0).to(x.dtype)  # [BLOCK_C, BLOCK_N]; FP8 -> x's dtype is exact
        if SCALE == 1:  # the step's column of the block grid, one scale an output column
            block_scale = tl.load(scale_ptr + (cols // SCALE_N) * stride_s_n
                                  + step * BLOCK_C // SCALE_C, mask=cols < N, other=0.0)
            acc += _dot(x, w, tl.zeros([BLOCK_T, BLOCK_N], tl.float32), IEEE_FP32) * \
                block_scale[None, :]
        else:
            acc = _dot(x, w, acc, IEEE_FP32)
    return acc


@triton.jit
def _with_bias(acc, bias_ptr, cols, N, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_T, BLOCK_N] float32 + bias (N,) at cols, before the one rounding (as cuBLAS's
    epilogue adds F.linear's bias)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return acc


@dataclass(frozen=True)
class GemvPlan:
    out_shape: tuple[int, int]  # [T, N]
    partials: torch.Tensor | None  # [S, T, N] float32, with more than one slice
    counters: torch.Tensor | None  # [N / BLOCK_N] int32, zero between calls
    launch: BoundLaunch | None  # None: no rows or no columns

    @property
    def holds_scratch(self) -> bool:  # PlanCache keeps it: a graph may write the partials
        return self.partials is not None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)  # [T, N]
        if self.launch is not None:
            self.launch(x_ptr=x, w_ptr=w, bias_ptr=out if bias is None else bias, out_ptr=out,
                        scale_ptr=out if weight_scale is None else weight_scale,
                        partial_ptr=self.partials if self.partials is not None else out,
                        counter_ptr=self.counters if self.counters is not None else out)
        return out


@dataclass(frozen=True)
class WeightScaling:
    """How the kernel reads an FP8 weight's float32 scale: `along` PER_SUM, one a row (`stride_n`
    0: one for the tensor); PER_STEP, one a (block_n x block_c) block, row blocks `stride_n`
    apart; NONE: not FP8."""
    along: ScaleAlongC = ScaleAlongC.NONE
    stride_n: int = 0
    block_n: int = 1
    block_c: int = 1

    @classmethod
    def of(cls, w: torch.Tensor, scale: torch.Tensor | None,
           fmt: WeightFormat | None) -> WeightScaling:
        """The scaling of w (N, C) and its checkpoint-layout scale in `fmt`, checked."""
        if w.dtype != FP8_DTYPE:
            if scale is not None:
                raise ValueError(f"weight_scale is for {FP8_DTYPE} weights, w is {w.dtype}: "
                                 "drop it")
            return cls()
        N, C = w.shape
        if fmt is None or fmt.fp8 is None or fmt.static_input or scale is None:
            raise ValueError(f"an {FP8_DTYPE} w needs weight_scale and a dynamic FP8 "
                             f"weight_format (WeightFormat.fp8_block() / fp8_channel() / "
                             f"fp8_tensor()), got weight_format={fmt}, weight_scale="
                             f"{'a tensor' if scale is not None else None}")
        if (tuple(scale.shape) not in fmt.linear_scale_shapes(N, C)
                or scale.dtype != torch.float32 or scale.device != w.device):
            raise ValueError(f"weight_scale must be float32 of shape "
                             f"{' or '.join(map(str, fmt.linear_scale_shapes(N, C)))} on "
                             f"{w.device} for a ({N}, {C}) weight in {fmt}, got {scale.dtype} "
                             f"{tuple(scale.shape)} on {scale.device} (pass scale.float())")
        if fmt.block is None:
            return cls(ScaleAlongC.PER_SUM,
                       scale.stride(0) if fmt.fp8 is Fp8Scaling.CHANNEL else 0)
        if scale.stride(1) != 1:
            raise ValueError(f"weight_scale's block grid is read row by row: pass "
                             f"scale.contiguous(), got strides {scale.stride()}")
        return cls(ScaleAlongC.PER_STEP, scale.stride(0), *fmt.block)


def plan_gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None,
              prefetch_weight: bool = False, has_bias: bool = False,
              scaling: WeightScaling = WeightScaling()) -> GemvPlan:
    T, C = x.shape
    N = w.shape[0]
    if T == 0 or N == 0:
        return GemvPlan((T, N), None, None, None)
    if config is None:
        config = choose_gemv_config(T, N, C, device_limits(x.device)[0],
                                    scaling.block_c if scaling.along is ScaleAlongC.PER_STEP
                                    else None)
    if scaling.along is ScaleAlongC.PER_STEP and scaling.block_c % config.block_c:
        raise ValueError(f"config.block_c={config.block_c} must divide the FP8 scale blocks' "
                         f"{scaling.block_c} columns")
    column_blocks = triton.cdiv(N, config.block_n)
    partials = counters = None
    if config.slices > 1:
        partials = torch.empty(config.slices, T, N, dtype=torch.float32, device=x.device)
        counters = arrival_counters(column_blocks, x.device)
    chained = prefetch_weight and dependent_launch(x.device)
    dot = T > 1 or config.tensor_cores
    fixed = dict(T=T, N=N, C=C, stride_x_t=x.stride(0), stride_w_n=w.stride(0),
                 stride_s_n=scaling.stride_n, stride_out_t=N, SLICES=config.slices,
                 IEEE_FP32=x.dtype == torch.float32, HAS_BIAS=has_bias, SCALE=scaling.along.value,
                 SCALE_N=scaling.block_n, SCALE_C=scaling.block_c, CHAINED=chained,
                 DOT=dot, LINE_ELEMENTS=min(config.block_c, L2_LINE_BYTES // w.element_size()),
                 BLOCK_T=max(16, triton.next_power_of_2(T)) if dot else 1,
                 BLOCK_N=config.block_n, BLOCK_C=config.block_c)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return GemvPlan((T, N), partials, counters,
                    BoundLaunch(_gemv_kernel, (column_blocks, config.slices), fixed, options))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, *, weight_scale: torch.Tensor | None = None,
         weight_format: WeightFormat | None = None,
         prefetch_weight: bool = False) -> torch.Tensor:
    """x (T <= 64, C) @ w (N, C).T (+ bias (N,)) -> a fresh (T, N) in x's dtype, as F.linear; x
    and w with unit last stride and one dtype (or w FP8, read as `weight_format` says its float32
    `weight_scale` is laid out: per tensor, per row or per block, as checkpoints store it) and
    device. `prefetch_weight`: w, its scale and bias are not written by the work queued before
    this call (a model's parameters), so on SM90 the kernel reads w while that work still runs
    (PDL)."""
    T, C = x.shape
    if (T > MAX_ROWS or w.dim() != 2 or w.shape[1] != C or x.stride(1) != 1 or w.stride(1) != 1
            or w.dtype not in (x.dtype, FP8_DTYPE) or x.device != w.device):
        raise ValueError(f"gemv takes x (T <= {MAX_ROWS}, C) and w (N, C) of x's dtype or "
                         f"{FP8_DTYPE} with unit last strides on one device, got x {x.dtype} "
                         f"{tuple(x.shape)} {x.stride()} on {x.device}, w {w.dtype} "
                         f"{tuple(w.shape)} {w.stride()} on {w.device}")
    scaling = WeightScaling.of(w, weight_scale, weight_format)
    if bias is not None and (bias.shape != w.shape[:1] or bias.stride(0) != 1
                             or bias.device != x.device or not bias.dtype.is_floating_point):
        raise ValueError(f"bias must be a float ({w.shape[0]},) with unit stride on {x.device}, "
                         f"one per output column, got {bias.dtype} {tuple(bias.shape)} on "
                         f"{bias.device}")
    signature = (tensor_signature(x), tensor_signature(w), tensor_signature(bias), scaling,
                 config, prefetch_weight,
                 torch.cuda.current_stream(x.device).stream_id if x.is_cuda else None)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, plan_gemv(x, w, config, prefetch_weight, bias is not None,
                                               scaling))
    return plan(x, w, bias, weight_scale)


def gemv_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """A decode step's projection x (..., C) @ w (N, C).T on a CUDA GPU, bf16 / fp16 alike, one
    row, or up to MAX_ROWS with a weight of at most ROWS_WEIGHT_BYTES, contiguous, eager (not
    traced by torch.compile), no gradients needed (the kernel has no backward), and a weight
    whose programs are resident at once (N <= block_n x PROGRAMS_PER_SM x SMs: not an LM head,
    whose own stream hides its ramp, where cuBLAS reads at ~0.9 of the bandwidth)."""
    if torch.compiler.is_compiling():  # first: the shape tests below would guard a trace
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and w.device == x.device and (bias is None or bias.device == x.device)
            and x.numel() > 0 and x.is_contiguous() and w.stride(-1) == 1
            and (rows == 1 or rows <= MAX_ROWS and w.numel() * w.element_size()
                 <= ROWS_WEIGHT_BYTES)
            and w.shape[0] <= GemvConfig.block_n * PROGRAMS_PER_SM * device_limits(x.device)[0]
            and not checks.grad_needed(x, w, bias))


_PLANS = PlanCache()


def gemv_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None,
               weight_format: WeightFormat | None = None) -> torch.Tensor:
    """The reference: float32 torch (an FP8 w dequantized by weights.dequantize_weight), in x's
    dtype."""
    if weight_scale is not None:
        w = dequantize_weight(w, weight_scale, weight_format)
    out = x.float() @ w.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)
