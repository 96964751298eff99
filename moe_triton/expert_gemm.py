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
from triton.tools.tensor_descriptor import TensorDescriptor

from ._expert_gemm_kernels import MXFP4_BF16_PAIRS, MXFP4_PORTABLE, _expert_gemm_kernel
from .activation import Activation
from .config import GemmConfig
from .expand import ExpertLayout, LayoutKind, by_expert_pad
from .launch import BoundLaunch
from .platform import interpreter_enabled
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
        """Fp8Scales.kernel_args's signature; the tiles do not change where these scales apply.
        Compiled, bf16 weights expand two a register (inline PTX the interpreter cannot run)."""
        expansion = MXFP4_PORTABLE if interpreter_enabled() else MXFP4_BF16_PAIRS
        return UNSCALED | dict(W_FP4=expansion.value, w_scale_up_offset=self.w_up_offset,
                               stride_ws_e=self.w.stride(0), stride_ws_n=self.w.stride(1),
                               stride_ws_c=self.w.stride(2))


UNSCALED = dict(A_SCALE=0, W_SCALE=0, W_SCALAR=False, A_GROUP=1, W_BLOCK_N=1, W_BLOCK_C=1,
                NAN_BITS=False, W_FP4=False, w_scale_up_offset=0, stride_as_m=0, stride_as_g=0,
                stride_ws_e=0, stride_ws_n=0, stride_ws_c=0)
NO_EPILOGUE = dict(ACT_KIND=-1, ACT_LIMIT=0.0, ACT_ALPHA=0.0)


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
    chained: bool = False,
    bias: torch.Tensor | None = None,
) -> ExpertGemmPlan:
    """chained: launched by PDL behind the kernel in front, and the next behind this one
    (platform.wait_then_release; its dependent_launch must allow it). bias [E, N] (any float
    dtype) is added to each row's sum before the activation; with split-C, to the first slice's
    partial."""
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
    by_expert = layout.kind is LayoutKind.BY_EXPERT
    # BY_EXPERT: a row block (of programs) an expert, each over all of its pairs
    num_m_blocks = (E if R else 0) if by_expert else R // layout.block_m
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
        CHAINED=chained and not persistent,
        PER_PAIR=layout.kind is LayoutKind.PER_PAIR,
        BY_EXPERT=by_expert, P_PAD=by_expert_pad(layout.num_pairs) if by_expert else 1,
        GATHER_TOP_K=layout.top_k if gather else 0,
        FUSED_GATE=gated, OUT_FP8=out_scales_shape is not None, IEEE_FP32=a.dtype == torch.float32,
        **(scales.kernel_args(C, config.block_n, config.block_c, config.scale_per_tile)
           if scales is not None else UNSCALED),
        **(activation.kernel_args() if activation is not None else NO_EPILOGUE),
        **config.kernel_args(),
    )
    tiles = num_m_blocks * triton.cdiv(n_out, config.block_n)  # the worst case's
    grid = (min(tiles, config.persistent_programs) if persistent else tiles, split_c)
    return plan(BoundLaunch(_expert_gemm_kernel, grid, fixed, config.launch_options()))


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
