"""RMSNorm in one kernel (optionally after the residual add, `add_rms_norm`), as transformers does:
`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dim, float32 statistics."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_triton.launch import BoundLaunch, PlanCache, interpreter_serialized, register_op
from moe_triton.platform import dependent_launch, triton_computes_exactly, wait_then_release
from moe_triton.weights import tensor_signature


@interpreter_serialized
@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, R, N, eps, stride_x_r,
                     stride_residual_r, stride_out_r, ADD_RESIDUAL: tl.constexpr,
                     CHAINED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # launched behind the kernel in front (PDL); the next (a projection, gemv.py) may then launch
    # and load its weights while this one runs
    wait_then_release(CHAINED)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < R) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x_r + cols[None, :], mask=mask,
                other=0.0)
    if ADD_RESIDUAL:  # the sum rounded to x's dtype, as torch's add rounds it, then normalised
        residual = tl.load(residual_ptr + rows[:, None].to(tl.int64) * stride_residual_r
                           + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None].to(tl.int64) * stride_out_r + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / N + eps)  # [BLOCK_R]
    normed = (x32 * rstd[:, None]).to(x.dtype)  # rounded before the weight, as transformers does
    weight = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out_r + cols[None, :], out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N), weight (N,) -> a fresh (..., N) in the dtype torch's `weight * normed` gives."""
    _check(x, weight)
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.rms_norm(x, weight, eps)
    return _compute(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both fresh."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x: {x.dtype} {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.add_rms_norm(x, residual, weight, eps)
    return _compute(x, residual, weight, eps)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")


def _compute(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    if not triton_computes_exactly(x.device, x.dtype) or x.dtype != weight.dtype:
        # the interpreter's bf16 casts truncate (platform.py)
        summed = x + residual if residual is not None else None
        return rms_norm_torch(summed if summed is not None else x, weight, eps), summed
    return _launch(x, residual, weight, eps)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])  # a view where t's layout allows
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows = _rows(x)  # [R, N]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [R, N]
    summed = torch.empty_like(out) if residual is not None else None  # [R, N]
    residual_rows = _rows(residual) if residual is not None else rows
    if rows.shape[0]:
        launch = _norm_launch(rows, residual_rows, weight, eps, residual is not None)
        launch(x_ptr=rows, residual_ptr=residual_rows, weight_ptr=weight, out_ptr=out,
               sum_ptr=summed if summed is not None else out)
    return out.view(x.shape), summed.view(x.shape) if summed is not None else None


def _norm_launch(rows, residual_rows, weight, eps: float, add_residual: bool) -> BoundLaunch:
    signature = (tensor_signature(rows), tensor_signature(residual_rows), tensor_signature(weight),
                 eps, add_residual)
    launch = _LAUNCHES.get(signature)
    if launch is None:
        R, N = rows.shape
        BLOCK_N = triton.next_power_of_2(N)
        BLOCK_R = max(1, min(16, 4096 // BLOCK_N))  # ~4096 elements a program
        fixed = dict(R=R, N=N, eps=eps, stride_x_r=rows.stride(0),
                     stride_residual_r=residual_rows.stride(0), stride_out_r=N,
                     ADD_RESIDUAL=add_residual, CHAINED=dependent_launch(rows.device),
                     BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
        launch = _LAUNCHES.add(signature, BoundLaunch(_rms_norm_kernel, (triton.cdiv(R, BLOCK_R),),
                                                      fixed))
    return launch


_LAUNCHES = PlanCache()


def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


@register_op("rms_norm", _rms_norm_fake)
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _compute(x, None, weight, eps)[0]


def _add_rms_norm_fake(x, residual, weight, eps):
    return (torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))


@register_op("add_rms_norm", _add_rms_norm_fake)
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _compute(x, residual, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference, transformers' RMSNorm: float32 statistics, the weight applied in x's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
