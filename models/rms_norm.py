"""RMSNorm in one kernel: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dimension.

    x [..., N] -> _rms_norm_kernel, one program per BLOCK_R rows: float32 statistics, the normalised
                  row rounded to x's dtype, then the weight applied (as transformers computes it)
               -> a fresh [..., N] in x's dtype

In torch that is seven kernels (cast, square, mean, add, rsqrt, multiply, cast and multiply); a
decode step runs four RMSNorms per layer (input, post-attention, and Qwen3 / Cohere2's per-head
q / k norms): one launch each instead of ~seven.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_triton.platform import triton_computes_exactly


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, R, N, eps, stride_x_r, stride_out_r,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < R) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x_r + cols[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / N + eps)  # [BLOCK_R]
    normed = (x32 * rstd[:, None]).to(x.dtype)  # rounded to the input dtype before the weight, as transformers
    weight = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out_r + cols[None, :], out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N), weight (N,) -> a fresh (..., N) in the dtype torch's `weight * normed` gives."""
    if x.shape[-1:] != weight.shape:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) for x of shape {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)}")
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.rms_norm(x, weight, eps)
    return _compute(x, weight, eps)


def _compute(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not triton_computes_exactly(x.device, x.dtype) or x.dtype != weight.dtype:
        return rms_norm_torch(x, weight, eps)  # the interpreter's bf16 casts truncate (platform.py)
    return _launch(x, weight, eps)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N)  # a view where x's layout allows (per-head q / k norms: the heads are rows)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [R, N]
    R = rows.shape[0]
    if R:
        BLOCK_N = triton.next_power_of_2(N)
        BLOCK_R = max(1, min(16, 4096 // BLOCK_N))  # ~4096 elements a program
        _rms_norm_kernel[(triton.cdiv(R, BLOCK_R),)](rows, weight, out, R, N, eps, rows.stride(0), out.stride(0),
                                                      BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
    return out.view(x.shape)


@torch.library.custom_op("moe_triton::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _compute(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference, transformers' RMSNorm: float32 statistics, the weight applied in the input dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
