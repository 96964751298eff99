"""Stage 3, expert GEMM: out[r] = a[row(r)] @ w[expert(r)].T for each row r in use, shape (R, N).

w has transformers' layout (E, N, C), C the contraction (K is top-k); strides are taken as given.
Operands are bf16/fp16 (fp32 for tests), FP8 e4m3 with float32 scales (`ScaleAlongC`), or MXFP4
weights beside float activations (W4A16: each weight tile expanded to a's dtype in registers, no
dequantized copy in memory); float32 accumulation. Fusions are data: per-expert biases, the gather
(row r reads token sorted_pair_ids[r] // K), the gated activation epilogue (gate columns n and up
columns I + n side by side: the [R, 2I] intermediate is never written), an FP8 output quantized per
(row, BLOCK_N columns), and split-C (float32 partials (S, R, N) that finalize sums in slice order,
bit-stable; never the first GEMM, whose activation needs the whole sum and which measured slower
split: docs/PERFORMANCE.md). NaN in an FP8 operand or scale reaches the output as in the float32
reference. Padding rows are never written (read as garbage only through a TMA descriptor, and masked
at the store). A grid has one program per tile of the worst case, those past the rows in use exiting
at once; the persistent form has a fixed number walk the tiles of the rows in use, counted on the
device (measured slower on SM90 with Triton 3.6, kept for the schedule it offers:
docs/PERFORMANCE.md, issue 27). At decode the second GEMM launches as a programmatic dependent (PDL)
of the first: its launch overlaps the first's tail, and it waits (griddepcontrol) before reading the
first's output.
"""
from __future__ import annotations

import enum
import functools
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation import Activation, _apply_activation
from .config import GemmConfig
from .expand import ExpertLayout, LayoutKind
from .launch import BoundLaunch, interpreter_serialized
from .platform import gdc_launch_dependents, gdc_wait, interpreter_enabled
from .quantize import fp8_scale, nan_max, quantize_tile
from .weights import FLOAT_DTYPES, FP8_DTYPE, MXFP4_DTYPE, MXFP4_GROUP


class ScaleAlongC(enum.Enum):  # where a scale applies, by whether it changes along C
    NONE = 0  # unscaled operand
    PER_STEP = 1  # changes along C in groups of whole steps (per-group activations, weight blocks)
    PER_SUM = 2  # constant along C (per token, per output row): the finished sum
    IN_STEP = 3  # within a step (groups < BLOCK_C; an 8-bit dot needs K >= 32 on SM90): the tiles


@dataclass(frozen=True, eq=False)
class Fp8Scales:
    """The float32 multipliers that dequantize one GEMM's FP8 operands."""
    a: torch.Tensor  # [rows of a, G]: row r's scale for columns [g * a_group, (g + 1) * a_group)
    a_group: int  # columns of a per scale (>= C: one scale per row)
    w: torch.Tensor  # [E, N_w / block_n, C / block_c] per block, or [E, N_w] per output row
    w_block: tuple[int, int] | None  # (block_n, block_c), or None for per-row weight scales
    w_up_offset: int = 0  # w's scale rows before the up half's (gated: the gate's rows)

    def a_along_c(self, c: int, block_c: int) -> ScaleAlongC:
        if self.a_group >= c:
            return ScaleAlongC.PER_SUM
        return ScaleAlongC.IN_STEP if self.a_group % block_c else ScaleAlongC.PER_STEP

    def w_along_c(self, block_c: int) -> ScaleAlongC:
        if self.w_block is None:
            return ScaleAlongC.PER_SUM
        return ScaleAlongC.IN_STEP if self.w_block[1] % block_c else ScaleAlongC.PER_STEP

    def kernel_args(self, c: int, block_n: int, block_c: int, per_tile: bool = False) -> dict:
        """per_tile: one weight scale per tile and step where the blocks allow (W_SCALAR)."""
        a_strides = (self.a.stride(0), self.a.stride(-1) if self.a.dim() > 1 else 0)
        # per row: one "block" column
        w_strides = self.w.stride() if self.w.dim() == 3 else (*self.w.stride(), 0)
        w_block_n, w_block_c = self.w_block or (1, 1)
        w_along_c = self.w_along_c(block_c)
        return dict(A_SCALE=self.a_along_c(c, block_c).value, W_SCALE=w_along_c.value,
                    W_SCALAR=(per_tile and w_along_c is ScaleAlongC.PER_STEP
                              and w_block_n % block_n == 0),
                    A_GROUP=self.a_group, W_BLOCK_N=w_block_n, W_BLOCK_C=w_block_c,
                    NAN_BITS=interpreter_enabled(), W_FP4=False,
                    w_scale_up_offset=self.w_up_offset,
                    stride_as_m=a_strides[0], stride_as_g=a_strides[1],
                    stride_ws_e=w_strides[0], stride_ws_n=w_strides[1], stride_ws_c=w_strides[2])


@dataclass(frozen=True, eq=False)
class Mxfp4Scales:
    """The E8M0 bytes that scale one GEMM's MXFP4 weights (weights.py): w [E, N_w, C / 32], one
    per 32 contraction values of an output row; activations unscaled (W4A16)."""
    w: torch.Tensor
    w_up_offset: int = 0  # w's scale rows before the up half's (gated: the gate's I rows)

    def kernel_args(self, c: int, block_n: int, block_c: int, per_tile: bool = False) -> dict:
        """Fp8Scales.kernel_args's signature; the tiles do not change where these scales apply."""
        return UNSCALED | dict(W_FP4=True, w_scale_up_offset=self.w_up_offset,
                               stride_ws_e=self.w.stride(0), stride_ws_n=self.w.stride(1),
                               stride_ws_c=self.w.stride(2))


UNSCALED = dict(A_SCALE=0, W_SCALE=0, W_SCALAR=False, A_GROUP=1, W_BLOCK_N=1, W_BLOCK_C=1,
                NAN_BITS=False, W_FP4=False, w_scale_up_offset=0, stride_as_m=0, stride_as_g=0,
                stride_ws_e=0, stride_ws_n=0, stride_ws_c=0)
NO_EPILOGUE = dict(ACT_KIND=-1, ACT_LIMIT=0.0, ACT_ALPHA=0.0)


@triton.jit
def _dot(a, w, acc, IEEE_FP32: tl.constexpr):
    if IEEE_FP32:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _step(a, w, acc, a_scale, w_scale, A_SCALE: tl.constexpr, W_SCALE: tl.constexpr,
          W_SCALAR: tl.constexpr, IEEE_FP32: tl.constexpr):
    """acc + a @ w for one C step. FP8 products start a fresh tensor-core sum each step, added in
    float32: Hopper accumulates FP8 in fewer bits than float32 (Triton keeps that on SM90); this
    per-step promotion (DeepSeek-V3's) bounds the drift (docs/PERFORMANCE.md, issue 26).
    W_SCALAR: w_scale is the tile's one weight-block scale, so the promotion is one FMA per element
    (a per-row product), not a multiply by a per-element outer product and an add."""
    if A_SCALE + W_SCALE == 0:
        return _dot(a, w, acc, IEEE_FP32)
    if (A_SCALE == 3) | (W_SCALE == 3):  # groups inside the step: scale the tiles, then the dot
        a_tile = a.to(tl.float32)
        w_tile = w.to(tl.float32)
        if A_SCALE == 3:
            a_tile = a_tile * a_scale
        if W_SCALE == 3:
            w_tile = w_tile * w_scale
        part = tl.dot(a_tile, w_tile, input_precision="tf32x3")  # float32-accurate
    else:
        part = tl.dot(a, w)
    # a scale that changes with the step applies to this step's product
    if (A_SCALE == 1) & (W_SCALE == 1):
        if W_SCALAR:
            part = part * (a_scale * w_scale)[:, None]
        else:
            part = part * (a_scale[:, None] * w_scale[None, :])
    elif A_SCALE == 1:
        part = part * a_scale[:, None]
    elif W_SCALE == 1:
        part = part * (w_scale if W_SCALAR else w_scale[None, :])
    return acc + part


@triton.jit
def _e4m3_nan(tile, axis: tl.constexpr):
    # 1 where a row (axis 1) or column (axis 0) of an e4m3 tile holds a NaN (0x7f, 0xff), else 0
    return tl.max(((tile.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F).to(tl.int32), axis=axis)


@triton.jit
def _mxfp4_scale(e8m0):
    """E8M0 bytes -> float32 2^(s - 127) times the 2^14 that _mxfp4_values leaves out; 255 is
    NaN (OCP MX), bytes above 240 (2^113) saturate, 0 (2^-127) is exact."""
    exponent = e8m0.to(tl.int32)
    scale = ((tl.minimum(exponent, 240) + 14) << 23).to(tl.float32, bitcast=True)
    return tl.where(exponent == 255, float("nan"), scale)


@triton.jit
def _mxfp4_values(codes, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """e2m1 codes [BLOCK_N, BLOCK_C / 2] (one nibble a byte: every other C) and their groups'
    scales [BLOCK_N, BLOCK_C / 32] -> weights in `dtype`, exact (a power of two times e2m1 fits
    bf16 and fp16 at a checkpoint's scales)."""
    # e2m1 (s, e1 e0, m) as float16 bits (s, 000 e1 e0, m 000000000) is its value times 2^-14,
    # the two subnormal codes included: an integer shift and an or per value
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    values = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    values = values.reshape(BLOCK_N, BLOCK_C // 32, 16) * scale[:, :, None]  # 16 codes a group
    return values.reshape(BLOCK_N, BLOCK_C // 2).to(dtype)


@triton.jit
def _mxfp4_dot(packed, e8m0, a_even_t, a_odd_t, acc, IEEE_FP32: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """acc + w @ a^T over one C step, as the even C's (low nibbles) plus the odd C's (high): the
    contraction split instead of interleaving the nibbles (3-10% faster at M <= 4 on the H200,
    level above: docs/PERFORMANCE.md, "MXFP4 experts")."""
    pairs = packed.to(tl.int32)  # [BN, BC / 2]
    scale = _mxfp4_scale(e8m0)
    dtype = a_even_t.dtype
    acc = _dot(_mxfp4_values(pairs & 0xF, scale, dtype, BLOCK_N, BLOCK_C), a_even_t, acc,
               IEEE_FP32)
    return _dot(_mxfp4_values(pairs >> 4, scale, dtype, BLOCK_N, BLOCK_C), a_odd_t, acc,
                IEEE_FP32)


@triton.jit
def _mxfp4_step(a, w_desc, w_tile, e8m0_tile, acc, acc_up, w_row, c_first, N, C, n_ok, up_offset,
                e8m0_up_offset, W_DESC: tl.constexpr, FUSED_GATE: tl.constexpr,
                IEEE_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """acc^T + w @ a^T for one C step of MXFP4 weights: the expanded tile is the MMA's first
    operand, which Hopper's wgmma reads from registers (the second it reads only from shared
    memory); a decode tile's few rows then sit in the MMA's narrow N, not its 64-row M."""
    offs_pair = tl.arange(0, BLOCK_C // 2)
    offs_group = tl.arange(0, BLOCK_C // 32)
    # C is a multiple of 32: a tail is whole pairs and whole groups
    pair_mask = n_ok[:, None] & (offs_pair < (C - c_first) // 2)[None, :]
    group_mask = n_ok[:, None] & (offs_group < (C - c_first) // 32)[None, :]
    a_even, a_odd = tl.split(a.reshape(a.shape[0], BLOCK_C // 2, 2))  # [BM, BC / 2] each
    a_even_t, a_odd_t = tl.trans(a_even), tl.trans(a_odd)
    if W_DESC:
        packed = w_desc.load([w_row, c_first // 2])
    else:
        packed = tl.load(w_tile, mask=pair_mask, other=0)
    e8m0 = tl.load(e8m0_tile, mask=group_mask, other=0)
    acc = _mxfp4_dot(packed, e8m0, a_even_t, a_odd_t, acc, IEEE_FP32, BLOCK_N, BLOCK_C)
    if FUSED_GATE:
        if W_DESC:
            packed_up = w_desc.load([w_row + N, c_first // 2])
        else:
            packed_up = tl.load(w_tile + up_offset, mask=pair_mask, other=0)
        e8m0_up = tl.load(e8m0_tile + e8m0_up_offset, mask=group_mask, other=0)
        acc_up = _mxfp4_dot(packed_up, e8m0_up, a_even_t, a_odd_t, acc_up, IEEE_FP32, BLOCK_N,
                            BLOCK_C)
    return acc, acc_up


@interpreter_serialized
@triton.jit
def _expert_gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr,
    sorted_pair_ids_ptr, block_expert_ptr, num_rows_ptr, topk_ids_ptr,
    a_scale_ptr, w_scale_ptr, out_scale_ptr, bias_ptr,
    N, C, E, num_pairs, num_m_blocks, up_offset, w_rows_per_expert, w_scale_up_offset,
    stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m, stride_out_split,
    stride_as_m, stride_as_g, stride_ws_e, stride_ws_n, stride_ws_c, stride_os_m, stride_b_e,
    A_DESC: tl.constexpr,  # row-space a through a TMA descriptor over (R, C)
    W_DESC: tl.constexpr,  # weights through a TMA descriptor over the (E * N_w, C) view
    PERSISTENT: tl.constexpr,  # the grid's programs walk the tiles of the rows in use (SORTED)
    TRIGGER: tl.constexpr,  # let the next kernel launch now (PDL; it waits for this grid's end)
    DEPENDENT: tl.constexpr,  # launched by PDL behind the kernel that writes a: wait for it first
    PER_PAIR: tl.constexpr,  # row block b holds pair b in its first row; its expert is topk_ids[b]
    GATHER_TOP_K: tl.constexpr,  # 0: a is in row space; k > 0: a row = pair // k
    FUSED_GATE: tl.constexpr,  # also accumulate the up columns at up_offset (gated activations)
    ACT_KIND: tl.constexpr,  # -1: no epilogue; else the activation applied before the store
    SPLIT_C: tl.constexpr,  # programs along C (grid axis 1); > 1 stores float32 partials per slice
    A_SCALE: tl.constexpr, W_SCALE: tl.constexpr,  # ScaleAlongC of a's and w's FP8 scales
    A_GROUP: tl.constexpr,  # columns of a per a-scale (PER_STEP: a multiple of BLOCK_C)
    NAN_BITS: tl.constexpr,  # FP8, interpreted: the product's NaN rows / columns from the e4m3 bits
    W_BLOCK_N: tl.constexpr, W_BLOCK_C: tl.constexpr,  # the weight block (W_SCALE per or in a step)
    W_SCALAR: tl.constexpr,  # PER_STEP weight scales: every tile lies in one weight block
    OUT_FP8: tl.constexpr,  # quantize the output tile per row, one scale per (row, BLOCK_N columns)
    W_FP4: tl.constexpr,  # MXFP4 weights, expanded to a's dtype in registers (W4A16)
    HAS_BIAS: tl.constexpr,  # add bias[expert] (gate columns, up at N) before the epilogue
    ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        # The tiles are those of the rows in use, read on the device: no host sync, no program
        # past them; flatten lets a tile's loads start under the previous tile's epilogue.
        m_blocks = tl.load(num_rows_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), m_blocks * num_n_blocks, tl.num_programs(0),
                             flatten=True):
            pid_m, pid_n = _tile_coordinates(tile, m_blocks, num_n_blocks, GROUP_M)
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            _gemm_tile(
                pid_m, pid_n, rows, tl.load(sorted_pair_ids_ptr + rows), expert,
                a_ptr, a_desc, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr,
                bias_ptr, N, C, num_pairs, up_offset, w_rows_per_expert, w_scale_up_offset,
                stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m,
                stride_out_split, stride_as_m, stride_as_g, stride_ws_e, stride_ws_n,
                stride_ws_c, stride_os_m, stride_b_e,
                A_DESC, W_DESC, GATHER_TOP_K, FUSED_GATE, ACT_KIND, SPLIT_C, A_SCALE, W_SCALE,
                A_GROUP, NAN_BITS, W_BLOCK_N, W_BLOCK_C, W_SCALAR, OUT_FP8, W_FP4, HAS_BIAS,
                ACT_LIMIT, ACT_ALPHA, IEEE_FP32, BLOCK_M, BLOCK_N, BLOCK_C)
    else:
        if TRIGGER:
            gdc_launch_dependents()
        pid_m, pid_n = _tile_coordinates(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
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
        if DEPENDENT:  # the routing and layout are older than the kernel before: read already
            gdc_wait()  # a (the kernel before's output) is complete and visible from here on
        _gemm_tile(
            pid_m, pid_n, rows, pair, expert,
            a_ptr, a_desc, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr,
            bias_ptr, N, C, num_pairs, up_offset, w_rows_per_expert, w_scale_up_offset,
            stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m,
            stride_out_split, stride_as_m, stride_as_g, stride_ws_e, stride_ws_n, stride_ws_c,
            stride_os_m, stride_b_e,
            A_DESC, W_DESC, GATHER_TOP_K, FUSED_GATE, ACT_KIND, SPLIT_C, A_SCALE, W_SCALE,
            A_GROUP, NAN_BITS, W_BLOCK_N, W_BLOCK_C, W_SCALAR, OUT_FP8, W_FP4, HAS_BIAS,
            ACT_LIMIT, ACT_ALPHA, IEEE_FP32, BLOCK_M, BLOCK_N, BLOCK_C)


@triton.jit
def _tile_coordinates(tile, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row blocks (one expert's, mostly) share each column block of
    # weights while it is hot in L2.
    group = tile // (GROUP_M * num_n_blocks)
    first_m = group * GROUP_M
    group_size = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n_blocks)) % group_size
    pid_n = (tile % (GROUP_M * num_n_blocks)) // group_size
    return pid_m, pid_n


@triton.jit
def _gemm_tile(
    pid_m, pid_n, rows, pair, expert,
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr, bias_ptr,
    N, C, num_pairs, up_offset, w_rows_per_expert, w_scale_up_offset,
    stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m, stride_out_split,
    stride_as_m, stride_as_g, stride_ws_e, stride_ws_n, stride_ws_c, stride_os_m, stride_b_e,
    A_DESC: tl.constexpr, W_DESC: tl.constexpr, GATHER_TOP_K: tl.constexpr,
    FUSED_GATE: tl.constexpr, ACT_KIND: tl.constexpr, SPLIT_C: tl.constexpr,
    A_SCALE: tl.constexpr, W_SCALE: tl.constexpr, A_GROUP: tl.constexpr, NAN_BITS: tl.constexpr,
    W_BLOCK_N: tl.constexpr, W_BLOCK_C: tl.constexpr, W_SCALAR: tl.constexpr,
    OUT_FP8: tl.constexpr, W_FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) output tile of one expert: rows `rows` hold pairs `pair`."""
    is_real = pair < num_pairs
    if GATHER_TOP_K > 0:
        a_rows = (pair // GATHER_TOP_K).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    # This program's slice of the C steps (all of them without split-C).
    c_steps = tl.cdiv(C, BLOCK_C)
    steps_per_split = tl.cdiv(c_steps, SPLIT_C)
    first_step = tl.program_id(1) * steps_per_split
    last_step = min(first_step + steps_per_split, c_steps)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    c_start = first_step * BLOCK_C
    a_tile = a_ptr + a_rows[:, None] * stride_a_m + (c_start + offs_c)[None, :] * stride_a_c
    if W_FP4:  # packed pairs [BLOCK_N, BLOCK_C / 2] and their E8M0 bytes [BLOCK_N, BLOCK_C / 32]
        w_tile = (w_ptr + expert * stride_w_e + offs_n[:, None].to(tl.int64) * stride_w_n
                  + (c_start // 2 + tl.arange(0, BLOCK_C // 2))[None, :] * stride_w_c)
        e8m0_tile = (w_scale_ptr + expert * stride_ws_e + offs_n[:, None] * stride_ws_n
                     + (c_start // 32 + tl.arange(0, BLOCK_C // 32))[None, :] * stride_ws_c)
    else:
        w_tile = (w_ptr + expert * stride_w_e + offs_n[None, :].to(tl.int64) * stride_w_n
                  + (c_start + offs_c)[:, None] * stride_w_c)
    a_scale_row = a_scale_ptr + a_rows * stride_as_m  # [BLOCK_M]
    w_scale_rows = (w_scale_ptr + expert * stride_ws_e
                    + (offs_n // W_BLOCK_N) * stride_ws_n)  # [BLOCK_N]
    w_scale_tile = w_scale_ptr + expert * stride_ws_e + (pid_n * BLOCK_N // W_BLOCK_N) * stride_ws_n
    n_ok = offs_n < N

    if W_FP4:  # transposed until the epilogue (_mxfp4_step)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nan_rows = tl.zeros([BLOCK_M], dtype=tl.int32)  # NAN_BITS: rows of a / columns of w with NaN
    nan_cols = tl.zeros([BLOCK_N], dtype=tl.int32)
    nan_cols_up = tl.zeros([BLOCK_N], dtype=tl.int32)
    # Descriptor tiles may run past this expert's N rows (next expert, up half): garbage columns,
    # masked at the store; a's run over padding rows (unwritten): garbage rows, masked too.
    # C tails are zero-filled.
    w_row = (expert * w_rows_per_expert + pid_n * BLOCK_N).to(tl.int32)
    a_row = (pid_m * BLOCK_M).to(tl.int32)
    for step in range(first_step, last_step):
        c_first = step * BLOCK_C
        c_ok = offs_c < C - c_first
        if A_DESC:
            a = a_desc.load([a_row, c_first])
        else:
            a = tl.load(a_tile, mask=is_real[:, None] & c_ok[None, :], other=0.0)
        w_mask = c_ok[:, None] & n_ok[None, :]
        # FP8 scales: per row of a / column of w (PER_STEP), per element (IN_STEP), else unread
        a_scale = 0.0
        w_scale = 0.0
        w_up_scale = 0.0
        if A_SCALE == 1:
            a_scales = a_scale_row + (c_first // A_GROUP) * stride_as_g  # [BLOCK_M]
            a_scale = tl.load(a_scales, mask=is_real, other=0.0)
        elif A_SCALE == 3:
            a_scales = a_scale_row[:, None] + ((c_first + offs_c) // A_GROUP)[None, :] * stride_as_g
            a_scale = tl.load(a_scales, mask=is_real[:, None] & c_ok[None, :],
                              other=0.0)  # [BM, BC]
        if W_SCALE == 1:
            if W_SCALAR:  # the tile lies in one weight block: one scale (its first column's)
                w_scales = w_scale_tile + (c_first // W_BLOCK_C) * stride_ws_c
                w_scale = tl.load(w_scales)
                if FUSED_GATE:
                    w_up_scale = tl.load(w_scales + w_scale_up_offset * stride_ws_n)
            else:
                w_scales = w_scale_rows + (c_first // W_BLOCK_C) * stride_ws_c  # [BLOCK_N]
                w_scale = tl.load(w_scales, mask=n_ok, other=0.0)
                if FUSED_GATE:
                    w_up_scale = tl.load(w_scales + w_scale_up_offset * stride_ws_n, mask=n_ok,
                                         other=0.0)
        elif W_SCALE == 3:
            groups = (c_first + offs_c) // W_BLOCK_C
            w_scales = w_scale_rows[None, :] + groups[:, None] * stride_ws_c  # [BLOCK_C, BLOCK_N]
            w_scale = tl.load(w_scales, mask=w_mask, other=0.0)
            if FUSED_GATE:
                w_up_scale = tl.load(w_scales + w_scale_up_offset * stride_ws_n, mask=w_mask,
                                     other=0.0)
        if W_FP4:
            acc, acc_up = _mxfp4_step(a, w_desc, w_tile, e8m0_tile, acc, acc_up, w_row, c_first,
                                      N, C, n_ok, up_offset, w_scale_up_offset * stride_ws_n,
                                      W_DESC, FUSED_GATE, IEEE_FP32, BLOCK_N, BLOCK_C)
        else:
            if W_DESC:
                w = w_desc.load([w_row, c_first]).T
            else:
                w = tl.load(w_tile, mask=w_mask, other=0.0)
            acc = _step(a, w, acc, a_scale, w_scale, A_SCALE, W_SCALE, W_SCALAR, IEEE_FP32)
            if NAN_BITS:
                nan_rows = nan_rows | _e4m3_nan(a, 1)
                nan_cols = nan_cols | _e4m3_nan(w, 0)
        if FUSED_GATE and not W_FP4:
            if W_DESC:
                w_up = w_desc.load([w_row + N, c_first]).T
            else:
                w_up = tl.load(w_tile + up_offset, mask=w_mask, other=0.0)
            acc_up = _step(a, w_up, acc_up, a_scale, w_up_scale, A_SCALE, W_SCALE, W_SCALAR,
                           IEEE_FP32)
            if NAN_BITS:
                nan_cols_up = nan_cols_up | _e4m3_nan(w_up, 0)
        a_tile += BLOCK_C * stride_a_c
        if W_FP4:
            w_tile += BLOCK_C // 2 * stride_w_c
            e8m0_tile += BLOCK_C // 32 * stride_ws_c
        else:
            w_tile += BLOCK_C * stride_w_c

    if W_FP4:
        acc = tl.trans(acc)  # [BM, BN]
        acc_up = tl.trans(acc_up)
    if NAN_BITS:  # the interpreter's dot reads e4m3 NaN as 480: restore a GPU's NaN
        acc = tl.where((nan_rows[:, None] | nan_cols[None, :]) > 0, float("nan"), acc)
        acc_up = tl.where((nan_rows[:, None] | nan_cols_up[None, :]) > 0, float("nan"), acc_up)

    if A_SCALE == 2:  # constant along C: scale the sums once
        a_sum_scale = tl.load(a_scale_row, mask=is_real, other=0.0)[:, None]
        acc *= a_sum_scale
        acc_up *= a_sum_scale
    if W_SCALE == 2:
        acc *= tl.load(w_scale_rows, mask=n_ok, other=0.0)[None, :]
        if FUSED_GATE:
            acc_up *= tl.load(w_scale_rows + w_scale_up_offset * stride_ws_n, mask=n_ok,
                              other=0.0)[None, :]
    if HAS_BIAS:
        if tl.program_id(1) == 0:  # split-C: the first slice's partial carries the bias
            bias = bias_ptr + expert * stride_b_e + offs_n
            acc += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if FUSED_GATE:
                acc_up += tl.load(bias + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT_KIND >= 0:
        acc = _apply_activation(acc, acc_up, ACT_KIND, ACT_LIMIT, ACT_ALPHA)
    out = (out_ptr + tl.program_id(1) * stride_out_split + rows[:, None].to(tl.int64) * stride_out_m
           + offs_n[None, :])
    out_mask = is_real[:, None] & n_ok[None, :]
    if OUT_FP8:  # columns past N (a descriptor tile's overrun) must not enter the row's max
        scale = fp8_scale(nan_max(tl.where(n_ok[None, :], tl.abs(acc), 0.0), 1))  # [BLOCK_M]
        tl.store(out_scale_ptr + rows.to(tl.int64) * stride_os_m + pid_n, scale, mask=is_real)
        tl.store(out, quantize_tile(acc, scale[:, None]), mask=out_mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def weight_descriptor(w: torch.Tensor, block: tuple[int, int]):
    """A TMA descriptor over w as (E * N, C) in `block` tiles, cached per tile shape while w lives
    at one address (weights do not move); the launcher still encodes it at every launch."""
    key = id(w)
    entry = _DESCRIPTORS.get(key)
    if entry is None or entry[0]() is not w or entry[1] != w.data_ptr():
        entry = (weakref.ref(w, lambda _, key=key: _DESCRIPTORS.pop(key, None)), w.data_ptr(), {})
        _DESCRIPTORS[key] = entry
    descriptor = entry[2].get(block)
    if descriptor is None:
        # Over a detached alias: a view of w itself would keep w (its _base) and this entry alive.
        descriptor = entry[2][block] = TensorDescriptor.from_tensor(w.detach().view(-1, w.shape[2]),
                                                                    list(block))
    return descriptor


# id(w) -> (weakref to w, its address, {tile: descriptor}); a dead w's entry drops by the callback.
_DESCRIPTORS: dict[int, tuple] = {}


def takes_descriptor(t: torch.Tensor) -> bool:
    # TMA needs contiguous rows of a 16-byte multiple
    return t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0


def _check_scales(scales: Fp8Scales | Mxfp4Scales, a: torch.Tensor, w: torch.Tensor) -> None:
    if isinstance(scales, Mxfp4Scales):
        if w.dtype != MXFP4_DTYPE or a.dtype not in FLOAT_DTYPES or a.shape[1] % MXFP4_GROUP:
            raise ValueError(f"MXFP4 scales were given but a is {a.dtype} with C={a.shape[1]} "
                             f"and w is {w.dtype}: w must be packed {MXFP4_DTYPE} and a float, "
                             f"C a multiple of {MXFP4_GROUP}")
        return
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 scales were given but a is {a.dtype} and w is {w.dtype}; "
                         f"both must be {FP8_DTYPE}")


@dataclass(frozen=True)
class ExpertGemmPlan:
    """`expert_gemm` for one signature: valid for any tensors with the metadata planned from."""

    out_shape: tuple[int, ...]  # [R, N_out], or [S, R, N] float32 split-C partials
    out_dtype: torch.dtype
    out_scales_shape: tuple[int, int] | None  # [R, N_out / BLOCK_N] with an FP8 output, else None
    config: GemmConfig
    descriptor: bool  # weights through a TMA descriptor
    a_descriptor: bool  # row-space a through a TMA descriptor
    launch: BoundLaunch | None  # None: no row blocks or no output columns, nothing to compute
    packing: int = 1  # weight values per stored element along C (MXFP4: 2)

    def __call__(self, a: torch.Tensor, w: torch.Tensor, layout: ExpertLayout,
                 a_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """(out, out_scales), out_scales None unless FP8 out; scales and bias as planned."""
        out, out_scales = self.outputs(a.device, out)
        if self.launch is not None:
            block = (self.config.block_n, self.config.block_c // self.packing)
            w_desc = weight_descriptor(w, block) if self.descriptor else w
            # a is fresh each call: its descriptor is too (a host object, encoded at launch)
            a_desc = (TensorDescriptor.from_tensor(a, [self.config.block_m, self.config.block_c])
                      if self.a_descriptor else a)
            self.launch(**_gemm_tensors(a, a_desc, w, w_desc, layout, a_scale, w_scale, out,
                                        out_scales, bias))
        return out, out_scales

    def outputs(self, device, out: torch.Tensor | None = None):
        """Fresh (out, out_scales); on the meta device, what a next stage plans from."""
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype,
                              device=device)  # [S, R, N] or [R, N_out]
        out_scales = None
        if self.out_scales_shape is not None:
            out_scales = torch.empty(self.out_scales_shape, dtype=torch.float32,
                                     device=device)  # [R, N_out / BLOCK_N]
        return out, out_scales


def _gemm_tensors(a, a_desc, w, w_desc, layout: ExpertLayout, a_scale, w_scale, out,
                  out_scales, bias) -> dict:
    sorted_pair_ids, block_expert, num_rows = layout.block_tensors()
    unread = out  # the pointer a kernel without that tensor is given
    return dict(a_ptr=a, a_desc=a_desc, w_ptr=w, w_desc=w_desc, out_ptr=out,
                sorted_pair_ids_ptr=sorted_pair_ids, block_expert_ptr=block_expert,
                num_rows_ptr=num_rows, topk_ids_ptr=layout.topk_ids,
                a_scale_ptr=unread if a_scale is None else a_scale,
                w_scale_ptr=unread if w_scale is None else w_scale,
                out_scale_ptr=unread if out_scales is None else out_scales,
                bias_ptr=unread if bias is None else bias)


def plan_expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    layout: ExpertLayout,
    config: GemmConfig,
    *,
    gather: bool,
    activation: Activation | None = None,
    scales: Fp8Scales | Mxfp4Scales | None = None,
    out_dtype: torch.dtype | None = None,
    trigger: bool = False,
    dependent: bool = False,
    bias: torch.Tensor | None = None,
) -> ExpertGemmPlan:
    """trigger: the next kernel is a PDL dependent; dependent: this one is (platform.py's
    dependent_launch must allow both). bias [E, N] (any float dtype) is added to each row's sum
    before the activation; with split-C, to the first slice's partial."""
    if config.block_m != layout.block_m:
        raise ValueError(f"config.block_m={config.block_m} must equal the layout's "
                         f"block_m={layout.block_m}")
    if config.split_c > 1 and (activation is not None or out_dtype == FP8_DTYPE):
        raise ValueError(f"config.split_c={config.split_c} leaves partial sums, but an activation "
                         "or an FP8 output needs the whole sum: split only the second GEMM")
    if scales is not None:
        _check_scales(scales, a, w)
    fp4 = isinstance(scales, Mxfp4Scales)
    if fp4 and config.block_c % MXFP4_GROUP:
        raise ValueError(f"config.block_c={config.block_c}: an MXFP4 C step holds whole "
                         f"{MXFP4_GROUP}-value scale groups (block_c a multiple of {MXFP4_GROUP})")
    E, N, C = w.shape
    packing = 2 if fp4 else 1
    C *= packing
    split_c = config.split_c
    gated = activation is not None and activation.gated
    n_out = N // 2 if gated else N
    out_dtype = out_dtype or (torch.bfloat16 if a.dtype == FP8_DTYPE else a.dtype)
    R = layout.max_rows
    num_m_blocks = R // layout.block_m
    out_shape, out_strides = (((split_c, R, N), (R * N, N)) if split_c > 1
                              else ((R, n_out), (0, n_out)))
    if split_c > 1:
        out_dtype = torch.float32
    out_scales_shape = (R, triton.cdiv(n_out, config.block_n)) if out_dtype == FP8_DTYPE else None
    sorted_layout = layout.kind is LayoutKind.SORTED
    descriptor = config.tma_weights and takes_descriptor(w)
    a_descriptor = config.tma_activations and not gather and sorted_layout and takes_descriptor(a)
    persistent = config.persistent_programs > 0 and sorted_layout
    plan = functools.partial(ExpertGemmPlan, out_shape, out_dtype, out_scales_shape, config,
                             descriptor, a_descriptor, packing=packing)
    if num_m_blocks == 0 or n_out == 0:
        return plan(None)
    fixed = dict(
        N=n_out, C=C, E=E, num_pairs=layout.num_pairs, num_m_blocks=num_m_blocks,
        up_offset=n_out * w.stride(1), w_rows_per_expert=N,
        stride_a_m=a.stride(0), stride_a_c=a.stride(1),
        stride_w_e=w.stride(0), stride_w_n=w.stride(1), stride_w_c=w.stride(2),
        stride_out_m=out_strides[1], stride_out_split=out_strides[0],
        stride_os_m=out_scales_shape[1] if out_scales_shape is not None else 0,
        stride_b_e=bias.stride(0) if bias is not None else 0, HAS_BIAS=bias is not None,
        A_DESC=a_descriptor, W_DESC=descriptor, PERSISTENT=persistent,
        TRIGGER=trigger and not persistent, DEPENDENT=dependent and not persistent,
        PER_PAIR=layout.kind is LayoutKind.PER_PAIR,
        GATHER_TOP_K=layout.top_k if gather else 0,
        FUSED_GATE=gated, OUT_FP8=out_scales_shape is not None, IEEE_FP32=a.dtype == torch.float32,
        **(scales.kernel_args(C, config.block_n, config.block_c, config.scale_per_tile)
           if scales is not None else UNSCALED),
        **(activation.kernel_args() if activation is not None else NO_EPILOGUE),
        **config.kernel_args(),
    )
    tiles = num_m_blocks * triton.cdiv(n_out, config.block_n)  # the worst case's
    grid = (min(tiles, config.persistent_programs) if persistent else tiles, split_c)
    options = config.launch_options() | (dict(launch_pdl=True) if fixed["DEPENDENT"] else {})
    return plan(BoundLaunch(_expert_gemm_kernel, grid, fixed, options))


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    layout: ExpertLayout,
    config: GemmConfig,
    *,
    gather: bool,
    activation: Activation | None = None,
    scales: Fp8Scales | Mxfp4Scales | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """a (T, C) if `gather` else (R, C), w (E, N, C) -> (R, N), or (R, N / 2) when gated; MXFP4
    w is packed (E, N, C / 2). Shapes are checked by the caller (pipeline.run_experts). out_dtype
    defaults to a's (FP8: bf16); float8_e4m3fn returns (out, out_scales (R, N_out / BLOCK_N));
    split_c > 1: float32 (S, R, N). bias (E, N) joins each row's sum before the activation."""
    plan = plan_expert_gemm(a, w, layout, config, gather=gather, activation=activation,
                            scales=scales, out_dtype=out_dtype, bias=bias)
    if out is not None and (tuple(out.shape) != plan.out_shape or out.dtype != plan.out_dtype
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {plan.out_dtype} tensor of shape "
                         f"{plan.out_shape}, got {out.dtype} {tuple(out.shape)} with strides "
                         f"{out.stride()}")
    a_scale = scales.a if isinstance(scales, Fp8Scales) else None
    out, out_scales = plan(a, w, layout, a_scale, None if scales is None else scales.w, out=out,
                           bias=bias)
    return (out, out_scales) if out_scales is not None else out


def expert_gemm_torch(a: torch.Tensor, w: torch.Tensor, row_tokens: torch.Tensor,
                      row_experts: torch.Tensor):
    """Reference: out[r] = a[row_tokens[r]] @ w[row_experts[r]].T in float32, for the given rows."""
    return torch.einsum("rc,rnc->rn", a.float()[row_tokens], w.float()[row_experts])
