"""Stage 3, expert GEMM: grouped GEMM over the expert-sorted row space of an `ExpertLayout`.

    out[r, :] = a[row(r), :] @ w[expert(r)].T        for every row r in use, shape (R, N)

`w` is in transformers' layout, (E, N, C): N output features, C the contraction width (the GEMM's
reduction dimension; K is reserved for top-k). w13 = gate_up_proj (E, 2I, H) and w2 = down_proj
(E, H, I). Strides are taken as given, so a transposed (E, C, N) view works too. Operands are
bf16/fp16 (fp32 accepted for tests), accumulation is float32.

Optional fusions, all expressed as data:
- gather (first GEMM): `a` is hidden_states (T, H) and row r reads token sorted_pair_ids[r] // K;
  otherwise `a` is already in the (R, C) row space (second GEMM).
- activation epilogue (first GEMM): the tile applies the `Activation` before its store. When gated,
  it accumulates the gate columns n and the up columns I + n side by side and writes
  act(gate) * up, shape (R, I): the [R, 2I] intermediate is never written. activation.py keeps
  the standalone kernel, and both call the same `_apply_activation`.
- split-C, the usual split-K (second GEMM at decode): with `config.split_c = S > 1` the reduction
  over C is cut into S slices, one program each, so a handful of rows still spreads the weight
  stream over every SM. Each slice stores float32 partial sums, shape (S, R, N), which finalize
  sums in slice order (bit-stable, no atomics). The first GEMM is never split: its activation
  needs the whole sum, and the H200 sweep measured every split of it slower (docs/sweep-split-k-*).

Padding rows (sentinel pair id) are neither read nor written: their output rows hold garbage,
which nothing downstream reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import Activation, _apply_activation
from .config import GemmConfig
from .expand import ExpertLayout, LayoutKind


@triton.jit
def _dot(a, w, acc, IEEE_FP32: tl.constexpr):
    if IEEE_FP32:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, w_desc, out_ptr,
    sorted_pair_ids_ptr, block_expert_ptr, num_rows_ptr, topk_ids_ptr,
    N, C, E, num_pairs, num_m_blocks, up_offset, w_rows_per_expert,
    stride_a_m, stride_a_c, stride_w_e, stride_w_n, stride_w_c, stride_out_m, stride_out_split,
    W_DESC: tl.constexpr,  # weights through a TMA descriptor over the (E * N_w, C) view, else pointers
    PER_PAIR: tl.constexpr,  # row block b holds pair b in its first row; its expert is topk_ids[b]
    GATHER_TOP_K: tl.constexpr,  # 0: a is in row space; k > 0: a row = pair // k
    FUSED_GATE: tl.constexpr,  # also accumulate the up columns at up_offset (gated activations)
    ACT_KIND: tl.constexpr,  # -1: no epilogue; else the activation applied before the store
    SPLIT_C: tl.constexpr,  # programs along C (grid axis 1); > 1 stores float32 partials per slice
    ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M row blocks share each column block while it is hot in L2.
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n_blocks)
    first_m = group * GROUP_M
    group_size = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n_blocks)) % group_size
    pid_n = (pid % (GROUP_M * num_n_blocks)) // group_size
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
    w_tile = (w_ptr + expert * stride_w_e + offs_n[None, :].to(tl.int64) * stride_w_n
              + (c_start + offs_c)[:, None] * stride_w_c)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Descriptor tiles may run past this expert's N rows into the next expert (or into the up
    # half): those columns are garbage and are masked at the store. C tails are zero-filled.
    w_row = (expert * w_rows_per_expert + pid_n * BLOCK_N).to(tl.int32)
    for step in range(first_step, last_step):
        c_left = C - step * BLOCK_C
        a = tl.load(a_tile, mask=is_real[:, None] & (offs_c[None, :] < c_left), other=0.0)
        w_mask = (offs_c[:, None] < c_left) & (offs_n[None, :] < N)
        if W_DESC:
            w = w_desc.load([w_row, step * BLOCK_C]).T
        else:
            w = tl.load(w_tile, mask=w_mask, other=0.0)
        acc = _dot(a, w, acc, IEEE_FP32)
        if FUSED_GATE:
            if W_DESC:
                w_up = w_desc.load([w_row + N, step * BLOCK_C]).T
            else:
                w_up = tl.load(w_tile + up_offset, mask=w_mask, other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE_FP32)
        a_tile += BLOCK_C * stride_a_c
        w_tile += BLOCK_C * stride_w_c

    if ACT_KIND >= 0:
        acc = _apply_activation(acc, acc_up, ACT_KIND, ACT_LIMIT, ACT_ALPHA)
    out = out_ptr + tl.program_id(1) * stride_out_split + rows[:, None].to(tl.int64) * stride_out_m + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_real[:, None] & (offs_n[None, :] < N))


def _weight_descriptor(w: torch.Tensor, config: GemmConfig):
    """A TMA descriptor over w viewed as (E * N, C), when the config asks for one and the layout
    allows it (contiguous, 16-byte aligned rows); else None and the kernel uses pointer loads."""
    if not config.tma_weights or not w.is_contiguous() or (w.shape[2] * w.element_size()) % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [config.block_n, config.block_c])


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    layout: ExpertLayout,
    config: GemmConfig,
    *,
    gather: bool,
    activation: Activation | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM in the row space of `layout`: shape (R, N), or (R, N / 2) with a gated activation.

    `a` is hidden_states, shape (T, C), when `gather`, else rows in layout order, shape (R, C).
    `w` has shape (E, N, C). Shapes are validated by the caller (fused_moe.run_experts).

    Split-C (`config.split_c` = S > 1) returns float32 partial sums, shape (S, R, N), for finalize
    to sum; it takes no activation (the first GEMM is never split).
    """
    if config.block_m != layout.block_m:
        raise ValueError(f"config.block_m={config.block_m} must equal the layout's block_m={layout.block_m}")
    if config.split_c > 1 and activation is not None:
        raise ValueError(f"config.split_c={config.split_c} leaves partial sums, but an activation needs the whole "
                         "sum: split only the second GEMM")
    E, N, C = w.shape
    split_c = config.split_c
    gated = activation is not None and activation.gated
    n_out = N // 2 if gated else N
    if split_c > 1:
        shape, dtype = (split_c, layout.max_rows, N), torch.float32
    else:
        shape, dtype = (layout.max_rows, n_out), a.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=a.device)  # [S, R, N] or [R, N_out]
    num_m_blocks = layout.max_rows // layout.block_m
    if num_m_blocks == 0 or n_out == 0:
        return out
    grid = (num_m_blocks * triton.cdiv(n_out, config.block_n), split_c)
    per_pair = layout.kind is LayoutKind.PER_PAIR
    w_desc = _weight_descriptor(w, config) or w
    # A PER_PAIR layout has no sorted buffers: the kernel reads only topk_ids there, and only the
    # sorted buffers otherwise, so the unused pointers may alias whatever tensor is at hand.
    sorted_pair_ids, block_expert, num_rows = ((layout.topk_ids,) * 3 if per_pair
                                               else (layout.sorted_pair_ids, layout.block_expert, layout.num_rows))
    _expert_gemm_kernel[grid](
        a, w, w_desc, out,
        sorted_pair_ids, block_expert, num_rows, layout.topk_ids,
        n_out, C, E, layout.num_pairs, num_m_blocks, n_out * w.stride(1), N,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(-2),
        out.stride(0) if split_c > 1 else 0,
        W_DESC=w_desc is not w, PER_PAIR=per_pair, GATHER_TOP_K=layout.top_k if gather else 0,
        FUSED_GATE=gated, ACT_KIND=activation.kind.value if activation is not None else -1, SPLIT_C=split_c,
        ACT_LIMIT=float(activation.swiglu_limit) if activation is not None else 0.0,
        ACT_ALPHA=float(activation.swiglu_alpha) if activation is not None else 0.0,
        IEEE_FP32=w.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_C=config.block_c, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def expert_gemm_torch(a: torch.Tensor, w: torch.Tensor, row_tokens: torch.Tensor, row_experts: torch.Tensor):
    """Reference: out[r] = a[row_tokens[r]] @ w[row_experts[r]].T in float32, for the given rows."""
    return torch.einsum("rc,rnc->rn", a.float()[row_tokens], w.float()[row_experts])
