"""FP8 activation quantization, once per token: x [T, C] -> q [T, C] e4m3, scales [T, G].

scale = max |x| over `group` columns / 448, or a static scale. `round_to_fp8` rounds in float32:
the interpreter misrounds a cast that carries into the exponent and flushes subnormals, but casts
e4m3 values exactly. NaN stays (README): tl.max drops it, the interpreter casts it to 384."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, interpreter_serialized
from .weights import FP8_DTYPE, FP8_MAX


@triton.jit
def round_to_fp8(x):
    """float32 x within +-448 rounded to the nearest e4m3 value, ties to even, still float32."""
    bits = x.to(tl.int32, bitcast=True)
    # below 2^-6 e4m3 is subnormal: a fixed 2^-9 step
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(e - 3)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    return ((x / step + magic) - magic) * step


@triton.jit
def quantize_tile(x, scale):
    """x / scale on the e4m3 grid, as float8e4nv; NaN (a NaN x or scale) as e4m3fn's NaN, 0x7f."""
    q = tl.clamp(x / scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = round_to_fp8(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(q != q, 0x7F, bits).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def nan_max(x, axis):
    has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.where(x != x, float("-inf"), x), axis=axis))


@triton.jit
def fp8_scale(amax):
    return tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL) / 448.0


MIN_PROGRAMS = 1024  # the fewest programs plan_quantize stacks rows down to


@interpreter_serialized
@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr,
    T, C, stride_x_t, stride_q_t, stride_s_t,
    GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr,
):
    # one program per (BLOCK_T rows, group): a program per row and group left most of a group's
    # 256 bytes to launch cost (47.5 us for 8 MB at Qwen3 M=4096)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_row = rows < T
    first = tl.program_id(1) * GROUP
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_t
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q_t
    if STATIC:
        scale = tl.zeros([BLOCK_T], dtype=tl.float32) + tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_T, BLOCK], dtype=tl.float32)
        for start in range(first, first + GROUP, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = is_row[:, None] & ((cols < C) & (cols < first + GROUP))[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        scale = fp8_scale(nan_max(amax, 1))  # [BLOCK_T]
        tl.store(scale_ptr + rows.to(tl.int64) * stride_s_t + tl.program_id(1), scale,
                 mask=is_row)
    for start in range(first, first + GROUP, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = is_row[:, None] & ((cols < C) & (cols < first + GROUP))[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + cols[None, :], quantize_tile(x, scale[:, None]), mask=mask)


@dataclass(frozen=True)
class QuantizePlan:
    shape: tuple[int, int]  # [T, C]
    num_groups: int  # G
    launch: BoundLaunch | None  # None: no rows or no columns

    def __call__(self, x: torch.Tensor, static_scale: torch.Tensor | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(q, scales), fresh or `out`'s buffers (contiguous, of outputs()' shapes)."""
        q, scales = out if out is not None else self.outputs(x.device, static_scale)
        if self.launch is not None:
            self.launch(x_ptr=x, q_ptr=q, scale_ptr=scales,
                        static_scale_ptr=static_scale if static_scale is not None else scales)
        return q, scales

    def outputs(self, device, static_scale: torch.Tensor | None = None):
        """A call's fresh (q, scales); on the meta device, the stand-ins a next stage plans from."""
        T, C = self.shape
        q = torch.empty(T, C, dtype=FP8_DTYPE, device=device)  # [T, C]
        if static_scale is not None:
            scales = static_scale.reshape(1, 1).expand(T, 1)  # [T, 1], stride 0: one for every row
        else:
            scales = torch.empty(T, self.num_groups, dtype=torch.float32, device=device)  # [T, G]
        return q, scales


def plan_quantize(x: torch.Tensor, group: int | None = None, static: bool = False) -> QuantizePlan:
    if (x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or x.stride(-1) != 1):
        raise ValueError(f"x must be a 2-D float tensor (T, C) with unit last stride, "
                         f"got {tuple(x.shape)} {x.dtype}")
    T, C = x.shape
    group = C if group is None else group
    if group < 1:
        raise ValueError(f"group must be >= 1 columns, got {group}")
    num_groups = triton.cdiv(C, group) if C else 0
    if T == 0 or C == 0:
        return QuantizePlan((T, C), num_groups, None)
    block = min(1024, triton.next_power_of_2(group))
    block_t = 1  # rows per program; a group wider than a tile loops over it, a row at a time
    # a group in one tile: rows stacked up to ~4096 elements while MIN_PROGRAMS or more remain
    # (several per SM: fewer left small batches latency-bound, measured at T = 16-256)
    while (group <= block and 2 * block_t * block <= 4096 and 2 * block_t <= T
           and triton.cdiv(T, 2 * block_t) * num_groups >= MIN_PROGRAMS):
        block_t *= 2
    fixed = dict(T=T, C=C, stride_x_t=x.stride(0), stride_q_t=C,
                 stride_s_t=0 if static else num_groups, GROUP=group, BLOCK_T=block_t,
                 BLOCK=block, STATIC=static)
    grid = (triton.cdiv(T, block_t), num_groups)
    return QuantizePlan((T, C), num_groups, BoundLaunch(_quantize_kernel, grid, fixed))


def quantize_fp8(x: torch.Tensor, group: int | None = None,
                 static_scale: torch.Tensor | None = None):
    """x (T, C) -> q (T, C) e4m3, scales (T, ceil(C / group)) float32, or static_scale as (T, 1)."""
    return plan_quantize(x, group, static_scale is not None)(x, static_scale)


def quantize_fp8_torch(x: torch.Tensor, group: int | None = None,
                       static_scale: torch.Tensor | None = None):
    """Reference: torch ops (torch's cast rounds to nearest even)."""
    T, C = x.shape
    group = C if group is None else group
    x = x.float()
    if static_scale is not None:
        scales = static_scale.float().reshape(1, 1).expand(T, 1)
        per_column = scales.expand(T, C)
    else:
        padded = torch.nn.functional.pad(x.abs(), (0, -C % group))  # [T, G * group]
        scales = (padded.view(T, -(-C // group), group).amax(dim=2).clamp(min=1e-12)
                  / FP8_MAX)  # [T, G]
        per_column = scales.repeat_interleave(group, dim=1)[:, :C]
    return (x / per_column).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize_fp8_torch(q: torch.Tensor, scales: torch.Tensor,
                         group: int | None = None) -> torch.Tensor:
    C = q.shape[1]
    group = C if group is None else group
    return q.float() * scales.float().repeat_interleave(group, dim=1)[:, :C]
