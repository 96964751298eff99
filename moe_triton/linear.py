"""The batch-invariant dense matmul: x (T, C) @ w (N, C).T -> (T, N) in x's dtype; and `dense`,
which picks a dense projection's kernel (this one in batch-invariant mode, gemv at one row).

One tile configuration for every T, no split along C: each output element sums its C products in
the same order whatever the number of rows, so a row's bits never depend on the others (torch's
matmul lets its BLAS pick kernels by the row count). Batch-invariant mode's router (invariance.py);
float32 accumulation, float32 inputs at IEEE precision (no TF32). `linear_torch`: the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import checks
from .gemv import gemv, gemv_applies
from .invariance import batch_invariant_enabled
from .launch import BoundLaunch, PlanCache, interpreter_serialized, register_op
from .platform import interpreter_hint, triton_can_run_on
from .weights import tensor_signature


@dataclass(frozen=True)
class LinearConfig:
    block_t: int = 32  # rows per program
    block_n: int = 64  # output columns per program
    block_c: int = 64  # contraction step (>= 32: SM90's 8-bit tl.dot; fixed: the sum's order)
    num_warps: int = 4

    def kernel_args(self) -> dict:
        return dict(BLOCK_T=self.block_t, BLOCK_N=self.block_n, BLOCK_C=self.block_c)


LINEAR_CONFIG = LinearConfig()  # the one configuration: invariance is what it is for


@interpreter_serialized
@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, out_ptr, T, N, C, stride_x_t, stride_x_c, stride_w_n, stride_w_c, stride_out_t,
    IEEE_FP32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for c_first in range(0, C, BLOCK_C):
        cs = c_first + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x_t + cs[None, :] * stride_x_c,
                    mask=(rows[:, None] < T) & (cs[None, :] < C), other=0.0)  # [BLOCK_T, BLOCK_C]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w_n + cs[:, None] * stride_w_c,
                    mask=(cols[None, :] < N) & (cs[:, None] < C), other=0.0)  # [BLOCK_C, BLOCK_N]
        if IEEE_FP32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out_t + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < N))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, C) @ w (N, C).T -> a fresh (T, N) in x's dtype, each row's bits independent of T. With
    gradients needed, or compiled: the op torch.ops.moe_triton.linear (backward in torch)."""
    _check_inputs(x, w)
    if torch.compiler.is_compiling() or checks.grad_needed(x, w):
        return torch.ops.moe_triton.linear(x, w)
    signature = (tensor_signature(x), tensor_signature(w))
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, plan_linear(x, w))
    return plan(x, w)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x (..., C), weight (N, C), bias), by the kernel that suits the call: a decode
    call on the GPU (up to gemv.MAX_ROWS rows) through gemv, its weight streamed while the kernel
    in front (the norm, the attention) still runs (`gemv_applies`; the bias in its epilogue); in
    batch-invariant mode (invariance.py) `linear`, whose rows' bits never depend on the rest of
    the batch (torch's BLAS picks kernels by the row count), the bias added after; else
    torch's."""
    if batch_invariant_enabled():
        out = linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
        return out if bias is None else out + bias  # an exact add: row by row
    if gemv_applies(x, weight, bias):
        return gemv(x.reshape(-1, x.shape[-1]), weight, bias, prefetch_weight=True).view(
            *x.shape[:-1], -1)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class LinearPlan:
    out_shape: tuple[int, int]  # [T, N]
    launch: BoundLaunch | None  # None: no rows or no columns

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)  # [T, N]
        if self.launch is not None:
            self.launch(x_ptr=x, w_ptr=w, out_ptr=out)
        return out


def plan_linear(x: torch.Tensor, w: torch.Tensor, config: LinearConfig = LINEAR_CONFIG):
    T, C = x.shape
    N = w.shape[0]
    if T == 0 or N == 0:
        return LinearPlan((T, N), None)
    fixed = dict(T=T, N=N, C=C, stride_x_t=x.stride(0), stride_x_c=x.stride(1),
                 stride_w_n=w.stride(0), stride_w_c=w.stride(1), stride_out_t=N,
                 IEEE_FP32=x.dtype == torch.float32, **config.kernel_args())
    grid = (triton.cdiv(T, config.block_t), triton.cdiv(N, config.block_n))
    return LinearPlan((T, N), BoundLaunch(_linear_kernel, grid, fixed,
                                          dict(num_warps=config.num_warps)))


_PLANS = PlanCache()

LINEAR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(x, w) -> None:
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in LINEAR_DTYPES:
            got = (f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"linear's {name} must be a 2-D tensor in one of {LINEAR_DTYPES}, "
                             f"got {got}")
    if x.dtype != w.dtype or x.device != w.device or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear multiplies x (T, C) by w (N, C).T of one dtype and device: got "
                         f"x {x.dtype} {tuple(x.shape)} on {x.device}, w {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    if not triton_can_run_on(x.device):
        raise ValueError(f"the batch-invariant matmul cannot run on {x.device}: move the tensors "
                         f"to a CUDA device or {interpreter_hint()}")


def linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference: float32 torch, in x's dtype (not batch-invariant: it is the value check)."""
    return (x.float() @ w.float().T).to(x.dtype)


# ---- the op torch.compile and autograd see ------------------------------------------------------

def _linear_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _linear_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, grad_out):
    x, w = ctx.saved_tensors
    return grad_out @ w, grad_out.T @ x  # [T, C], [N, C]


@register_op("linear", _linear_fake, backward=_linear_backward,
             setup_context=_linear_setup_context)
def _linear_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return linear(x, w)
