"""Rotary position embedding in one kernel: x * cos + rotate(x) * sin on the first D_rot dims of
every head, the rest passed through; rotate is rotate-half (Llama, Qwen, MiniMax) or pairwise
(Cohere's interleaved form).

    x [B, heads, L, D] (any strides, unit last), cos / sin [B, L, D_rot]
      -> _rotary_kernel, one program per BLOCK_R (b, head, l) rows: the rotation in float32,
         rounded once to x's dtype
      -> a fresh [B, heads, L, D], contiguous

In torch the rotation is ~8 kernels a tensor (slices, negation, concatenation, two products, a sum,
the pass-through concatenation); a decode layer rotates q and k: two launches instead of ~16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_triton.platform import triton_computes_exactly


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, HEADS, L,
                   stride_x_b, stride_x_h, stride_x_l, stride_c_b, stride_c_l,
                   D: tl.constexpr, D_ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, head, l) flattened, l fastest
    b, head, pos = rows // (HEADS * L), (rows // L) % HEADS, rows % L
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    x_row = b.to(tl.int64) * stride_x_b + head * stride_x_h + pos * stride_x_l  # [BLOCK_R]
    c_row = b.to(tl.int64) * stride_c_b + pos * stride_c_l
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...: rotate -> (-x1, x0), (-x3, x2), ...
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:  # halves: rotate -> (-x2, x1)
        partner = tl.where(cols < D_ROT // 2, cols + D_ROT // 2, cols - D_ROT // 2)
        sign = tl.where(cols < D_ROT // 2, -1.0, 1.0)
    rot = cols < D_ROT
    mask = row_ok[:, None] & (cols[None, :] < D)
    rot_mask = row_ok[:, None] & rot[None, :]
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0)  # [BLOCK_R, BLOCK_D]
    x_partner = tl.load(x_ptr + x_row[:, None] + partner[None, :], mask=rot_mask, other=0.0)
    cos = tl.load(cos_ptr + c_row[:, None] + cols[None, :], mask=rot_mask, other=1.0)
    sin = tl.load(sin_ptr + c_row[:, None] + cols[None, :], mask=rot_mask, other=0.0)
    # In float32, rounded once. Not torch's three roundings in x's dtype: the GPU compiler contracts
    # x * cos into the sum as an FMA whatever casts stand between them (seen on the H200), so a
    # bit-for-bit copy of torch is not on offer; one rounding is the more accurate of the two.
    rotated = x.to(tl.float32) * cos.to(tl.float32) + x_partner.to(tl.float32) * sign[None, :] * sin.to(tl.float32)
    out = tl.where(rot[None, :], rotated.to(x.dtype), x)
    out_row = rows.to(tl.int64) * D
    tl.store(out_ptr + out_row[:, None] + cols[None, :], out, mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x (B, heads, L, D); cos / sin (B, L, D_rot) in x's dtype -> a fresh (B, heads, L, D). A partial
    rotary (D_rot < D) rotates the first D_rot dims and passes the rest through."""
    B, heads, L, D = x.shape
    if cos.shape != sin.shape or cos.shape[:2] != (B, L) or cos.shape[2] > D or cos.shape[2] % 2:
        raise ValueError(f"cos / sin must be (B={B}, L={L}, D_rot <= {D}, even), got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if torch.compiler.is_compiling():
        return torch.ops.moe_triton.rotary(x, cos, sin, interleaved)
    return _compute(x, cos, sin, interleaved)


def _compute(x, cos, sin, interleaved: bool) -> torch.Tensor:
    if not triton_computes_exactly(x.device, x.dtype) or cos.dtype != x.dtype or x.stride(3) != 1:
        return apply_rotary_torch(x, cos, sin, interleaved)  # the interpreter's bf16 casts truncate (platform.py)
    B, heads, L, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, heads, L, D, dtype=x.dtype, device=x.device)
    R = B * heads * L
    if R:
        BLOCK_D = triton.next_power_of_2(D)
        BLOCK_R = max(1, min(32, 4096 // BLOCK_D))
        _rotary_kernel[(triton.cdiv(R, BLOCK_R),)](
            x, cos, sin, out, R, heads, L, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
            D=D, D_ROT=cos.shape[2], INTERLEAVED=interleaved, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return out


@torch.library.custom_op("moe_triton::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _compute(x, cos, sin, interleaved)


@_rotary_op.register_fake
def _(x, cos, sin, interleaved):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Cohere's rotation: pairs (x0, x1), (x2, x3), ... -> (-x1, x0), (-x3, x2), ..."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The reference, as transformers computes it, in x's dtype."""
    rotate = rotate_interleaved if interleaved else rotate_half
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = x_rot * cos + rotate(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.numel() else x_rot
