"""Decode-size projections, a first design: x (T, C) @ w (N, C).T -> (T, N), T <= 16.

A decode step's dense projections (attention's qkv and o, the LM head, shared experts) read each
weight once for a handful of rows: the work is the weight stream. Program (column block, slice of
C) multiplies all T rows (padded to 16 for the tensor cores) by its BLOCK_N x slice of w, so even
a narrow N fills the SMs; with more than one slice each program stores its float32 partial sums,
and the last program of a column block to finish (a counter it bumps with acquire-release
ordering) adds the slices in slice order and writes the output: no second launch, and the bits do
not depend on which program finished last. The counters return to zero after each call, so a plan
can be replayed in a CUDA graph; a plan's calls must not overlap in time (one stream).
`gemv_torch`: the reference. Not wired into models/ yet: measured level with cuBLAS on a decode
step (docs/PERFORMANCE.md, issue 30), the first design of the projections' kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, PlanCache, interpreter_serialized
from .weights import tensor_signature

MAX_ROWS = 16  # the tensor cores' smallest row tile: decode batches up to it


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # output columns per program
    block_c: int = 128  # contraction step
    slices: int = 1  # programs along C per column block (> 1: partials summed by the last)
    num_warps: int = 4
    num_stages: int = 4


def choose_gemv_config(N: int, C: int, num_sms: int) -> GemvConfig:
    """Two programs per SM or more, each slice at least four steps of the contraction."""
    config = GemvConfig()
    column_blocks = triton.cdiv(N, config.block_n)
    most = max(1, C // (4 * config.block_c))
    slices = min(most, max(1, triton.cdiv(2 * num_sms, column_blocks)))
    return GemvConfig(slices=slices)


@interpreter_serialized
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr,
    T, N, C, stride_x_t, stride_w_n, stride_out_t,
    SLICES: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(C, BLOCK_C)
    per_slice = tl.cdiv(steps, SLICES)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for step in range(pid_s * per_slice, min((pid_s + 1) * per_slice, steps)):
        cs = step * BLOCK_C + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + rows[:, None] * stride_x_t + cs[None, :],
                    mask=(rows[:, None] < T) & (cs[None, :] < C), other=0.0)  # [BLOCK_T, BLOCK_C]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w_n + cs[:, None],
                    mask=(cols[None, :] < N) & (cs[:, None] < C), other=0.0)  # [BLOCK_C, BLOCK_N]
        if IEEE_FP32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out_mask = (rows[:, None] < T) & (cols[None, :] < N)
    out = out_ptr + rows[:, None] * stride_out_t + cols[None, :]
    if SLICES == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rows[:, None] * N + cols[None, :]  # [BLOCK_T, BLOCK_N] of a slice's (T, N)
        tl.store(partial_ptr + pid_s * T * N + tile, acc, mask=out_mask)
        # release: this slice's partials are visible before the count; acquire: the last sees all
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SLICES - 1:
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for s in range(SLICES):  # slice order, whichever program came last
                total += tl.load(partial_ptr + s * T * N + tile, mask=out_mask, other=0.0)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call


@dataclass(frozen=True)
class GemvPlan:
    out_shape: tuple[int, int]  # [T, N]
    partials: torch.Tensor | None  # [S, T, N] float32, with more than one slice
    counters: torch.Tensor | None  # [N / BLOCK_N] int32, zero between calls
    launch: BoundLaunch | None  # None: no rows or no columns

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)  # [T, N]
        if self.launch is not None:
            self.launch(x_ptr=x, w_ptr=w, out_ptr=out,
                        partial_ptr=self.partials if self.partials is not None else out,
                        counter_ptr=self.counters if self.counters is not None else out)
        return out


def plan_gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> GemvPlan:
    T, C = x.shape
    N = w.shape[0]
    if T == 0 or N == 0:
        return GemvPlan((T, N), None, None, None)
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = choose_gemv_config(N, C, num_sms)
    column_blocks = triton.cdiv(N, config.block_n)
    partials = counters = None
    if config.slices > 1:
        partials = torch.empty(config.slices, T, N, dtype=torch.float32, device=x.device)
        counters = torch.zeros(column_blocks, dtype=torch.int32, device=x.device)
    fixed = dict(T=T, N=N, C=C, stride_x_t=x.stride(0), stride_w_n=w.stride(0), stride_out_t=N,
                 SLICES=config.slices, IEEE_FP32=x.dtype == torch.float32, BLOCK_T=MAX_ROWS,
                 BLOCK_N=config.block_n, BLOCK_C=config.block_c)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return GemvPlan((T, N), partials, counters,
                    BoundLaunch(_gemv_kernel, (column_blocks, config.slices), fixed, options))


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x (T <= 16, C) @ w (N, C).T -> a fresh (T, N) in x's dtype; both with unit last stride and
    one dtype and device."""
    T, C = x.shape
    if (T > MAX_ROWS or w.dim() != 2 or w.shape[1] != C or x.stride(1) != 1 or w.stride(1) != 1
            or x.dtype != w.dtype):
        raise ValueError(f"gemv takes x (T <= {MAX_ROWS}, C) and w (N, C) of one dtype with unit "
                         f"last strides, got x {x.dtype} {tuple(x.shape)} {x.stride()}, "
                         f"w {w.dtype} {tuple(w.shape)} {w.stride()}")
    signature = (tensor_signature(x), tensor_signature(w), config,
                 torch.cuda.current_stream(x.device).stream_id if x.is_cuda else None)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, plan_gemv(x, w, config))
    return plan(x, w)


_PLANS = PlanCache()


def gemv_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference: float32 torch, in x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)
