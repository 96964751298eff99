"""The expert GEMM's kernels (expert_gemm.py plans and launches them): one grid or persistent
kernel over (row block, column block) tiles, each tile's C steps in `_gemm_tile`; `_step` is one
step's MMA with FP8 scale promotion (decode.py calls it too), `_mxfp4_step` one step of MXFP4
weights expanded in registers; the epilogue adds biases, applies the activation and stores (or
quantizes) the tile."""
import triton
import triton.language as tl

from .activation import _apply_activation
from .launch import interpreter_serialized
from .platform import wait_then_release
from .quantize import fp8_scale, nan_max, quantize_tile


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


# W_FP4's expansions: PORTABLE, any dtype and the interpreter; BF16_PAIRS, bf16 on a GPU
MXFP4_PORTABLE = tl.constexpr(1)
MXFP4_BF16_PAIRS = tl.constexpr(2)

# One 32-bit register of 4 packed bytes -> the bf16 values of one nibble of each, two a register
# ($0: bytes 0, 1; $1: bytes 2, 3), times their scales ($3, $4: bf16 pairs). prmt spreads bytes
# 0, 1 (then 2, 3) into the two 16-bit halves; shifts place each code's magnitude bits at bf16's
# lowest exponent bit and top mantissa bit (6-8) and its sign at bit 15: the bf16 value is the
# e2m1 one times 2^-126 (the two subnormal codes too), so one mul.bf16x2 by 2^126 restores it and
# one by the scale applies the group's: ~2.5 instructions a value against ~8 one at a time.
_BF16_PAIRS_ASM = """{
.reg .b32 z, y, t, u, bias;
mov.b32 z, 0;
mov.b32 bias, 0x7E807E80;
prmt.b32 y, $2, z, 0x4140;
shl.b32 t, y, MAG; and.b32 t, t, 0x01C001C0;
shl.b32 u, y, SIGN; and.b32 u, u, 0x80008000;
or.b32 t, t, u; mul.rn.bf16x2 t, t, bias; mul.rn.bf16x2 $0, t, $3;
prmt.b32 y, $2, z, 0x4342;
shl.b32 t, y, MAG; and.b32 t, t, 0x01C001C0;
shl.b32 u, y, SIGN; and.b32 u, u, 0x80008000;
or.b32 t, t, u; mul.rn.bf16x2 t, t, bias; mul.rn.bf16x2 $1, t, $4;
}"""
_LOW_NIBBLES_ASM = tl.constexpr(_BF16_PAIRS_ASM.replace("MAG", "6").replace("SIGN", "12"))
_HIGH_NIBBLES_ASM = tl.constexpr(_BF16_PAIRS_ASM.replace("MAG", "2").replace("SIGN", "8"))


@triton.jit
def _mxfp4_bf16_pairs(packed, e8m0, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Packed pairs [BLOCK_N, BLOCK_C / 2] and their E8M0 bytes [BLOCK_N, BLOCK_C / 32] -> the
    bf16 weights of the low nibbles (even C's) and of the high ones (odd C's), the bits
    _mxfp4_values gives in bf16: 255 NaN, bytes above 240 as 240, 0 as 2^-127 (subnormal)."""
    exponent = tl.minimum(e8m0.to(tl.int32), 240)
    bits = tl.where(e8m0 == 255, 0x7FC0, tl.where(exponent == 0, 0x0040, exponent << 7))
    scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s - 127)
    scale = tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_C // 32, 16))
    scale = scale.reshape(BLOCK_N, BLOCK_C // 2)  # one a byte: 16 bytes a group
    even = tl.inline_asm_elementwise(_LOW_NIBBLES_ASM, "=r,=r,r,r,r", [packed, scale],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)
    odd = tl.inline_asm_elementwise(_HIGH_NIBBLES_ASM, "=r,=r,r,r,r", [packed, scale],
                                    dtype=tl.bfloat16, is_pure=True, pack=4)
    return even, odd


@triton.jit
def _mxfp4_expanded(packed, e8m0, dtype: tl.constexpr, W_FP4: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """The weights of the even C's (low nibbles) and of the odd C's (high) in `dtype`."""
    if W_FP4 == MXFP4_BF16_PAIRS and dtype == tl.bfloat16:
        even, odd = _mxfp4_bf16_pairs(packed, e8m0, BLOCK_N, BLOCK_C)
    else:
        pairs = packed.to(tl.int32)  # [BN, BC / 2]
        scale = _mxfp4_scale(e8m0)
        even = _mxfp4_values(pairs & 0xF, scale, dtype, BLOCK_N, BLOCK_C)
        odd = _mxfp4_values(pairs >> 4, scale, dtype, BLOCK_N, BLOCK_C)
    return even, odd


@triton.jit
def _mxfp4_dot(packed, e8m0, a_even_t, a_odd_t, acc, IEEE_FP32: tl.constexpr,
               W_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """acc + w @ a^T over one C step, as the even C's (low nibbles) plus the odd C's (high): the
    contraction split instead of interleaving the nibbles (3-10% faster at M <= 4 on the H200,
    level above: docs/PERFORMANCE.md, "MXFP4 experts")."""
    even, odd = _mxfp4_expanded(packed, e8m0, a_even_t.dtype, W_FP4, BLOCK_N, BLOCK_C)
    acc = _dot(even, a_even_t, acc, IEEE_FP32)
    return _dot(odd, a_odd_t, acc, IEEE_FP32)


@triton.jit
def _mxfp4_step(a, w_desc, w_tile, e8m0_tile, acc, acc_up, w_row, c_first, N, C, n_ok, up_offset,
                e8m0_up_offset, W_DESC: tl.constexpr, FUSED_GATE: tl.constexpr,
                IEEE_FP32: tl.constexpr, W_FP4: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_C: tl.constexpr):
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
    acc = _mxfp4_dot(packed, e8m0, a_even_t, a_odd_t, acc, IEEE_FP32, W_FP4, BLOCK_N, BLOCK_C)
    if FUSED_GATE:
        if W_DESC:
            packed_up = w_desc.load([w_row + N, c_first // 2])
        else:
            packed_up = tl.load(w_tile + up_offset, mask=pair_mask, other=0)
        e8m0_up = tl.load(e8m0_tile + e8m0_up_offset, mask=group_mask, other=0)
        acc_up = _mxfp4_dot(packed_up, e8m0_up, a_even_t, a_odd_t, acc_up, IEEE_FP32, W_FP4,
                            BLOCK_N, BLOCK_C)
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
    CHAINED: tl.constexpr,  # launched by PDL behind the kernel in front, and the next behind it
    PER_PAIR: tl.constexpr,  # row block b holds pair b in its first row; its expert is topk_ids[b]
    # row block e is expert e's: its pairs found in topk_ids [P_PAD], BLOCK_M a tile; pair p, row p
    BY_EXPERT: tl.constexpr, P_PAD: tl.constexpr,
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
    elif BY_EXPERT:
        wait_then_release(CHAINED)  # the routing may be the kernel before's
        pid_m, pid_n = _tile_coordinates(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
        p = tl.arange(0, P_PAD)
        ids = tl.load(topk_ids_ptr + p, mask=p < num_pairs, other=-1)
        mine = ids == pid_m  # [P_PAD]: expert pid_m's pairs (filtered ids: none)
        count = tl.sum(mine.to(tl.int32))
        # The expert's pairs in pair order, listed by this program in its row of the layout's
        # [E, P_PAD] scratch (sorted_pair_ids_ptr here; the expert's other programs write the
        # same values), then read back a tile at a time.
        listed = sorted_pair_ids_ptr + pid_m * P_PAD
        tl.store(listed + tl.cumsum(mine.to(tl.int32), 0) - 1, p, mask=mine)
        tl.debug_barrier()  # the program's stores visible to all of its threads
        for first in range(0, count, BLOCK_M):  # usually one tile; none: an unrouted expert
            slots = first + tl.arange(0, BLOCK_M)
            pair = tl.load(listed + slots, mask=slots < count, other=num_pairs)  # [BLOCK_M]
            _gemm_tile(
                pid_m, pid_n, pair, pair, pid_m.to(tl.int64),
                a_ptr, a_desc, w_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr,
                bias_ptr, N, C, num_pairs, up_offset, w_rows_per_expert, w_scale_up_offset,
                stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m,
                stride_out_split, stride_as_m, stride_as_g, stride_ws_e, stride_ws_n,
                stride_ws_c, stride_os_m, stride_b_e,
                A_DESC, W_DESC, GATHER_TOP_K, FUSED_GATE, ACT_KIND, SPLIT_C, A_SCALE, W_SCALE,
                A_GROUP, NAN_BITS, W_BLOCK_N, W_BLOCK_C, W_SCALAR, OUT_FP8, W_FP4, HAS_BIAS,
                ACT_LIMIT, ACT_ALPHA, IEEE_FP32, BLOCK_M, BLOCK_N, BLOCK_C)
    else:
        wait_then_release(CHAINED)  # the routing and layout too may be the kernel before's
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
                                      W_DESC, FUSED_GATE, IEEE_FP32, W_FP4, BLOCK_N, BLOCK_C)
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
