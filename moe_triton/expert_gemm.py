"""Stage 3, expert GEMM: grouped GEMM over the expert-sorted row space of an `ExpertLayout`.

    out[r, :] = a[row(r), :] @ w[expert(r)].T        for every row r in use, shape (R, N)

`w` is in transformers' layout, (E, N, K) with K the input features: w13 = gate_up_proj
(E, 2I, H) and w2 = down_proj (E, H, I). Strides are taken as given, so a transposed (E, K, N)
view works too. Operands are bf16/fp16 (fp32 accepted for tests), accumulation is float32.

Optional fusions, all expressed as data:
- gather (first GEMM): `a` is hidden_states (T, H) and row r reads token sorted_pair_ids[r] // K;
  otherwise `a` is already in the (R, K) row space (second GEMM).
- activation epilogue (first GEMM): the tile applies the `Activation` before its store. When gated,
  it accumulates the gate columns n and the up columns I + n side by side and writes
  act(gate) * up, shape (R, I): the [R, 2I] intermediate is never written. activation.py keeps
  the standalone kernel, and both call the same `_apply_activation`.
- split-K (decode): with `config.split_k = S > 1` the reduction over K is cut into S slices, one
  program each, so a handful of rows still spreads the weight stream over every SM. Each slice
  stores float32 partial sums, shape (S, R, N), and the sum happens where the next stage loads
  them, in a fixed order (bit-stable, no atomics): the second GEMM sums the first GEMM's partials
  and applies the activation as it loads its `a` tiles (`a_activation`), finalize sums the second
  GEMM's partials.

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
def _load_a(a_tile, mask, stride_a_split, a_up_offset, A_SPLITS: tl.constexpr, A_ACT_KIND: tl.constexpr,
            A_ACT_GATED: tl.constexpr, ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr, dtype: tl.constexpr):
    """An `a` tile: plain rows, or the previous GEMM's A_SPLITS float32 partials summed in slice
    order with the activation applied (then `a_tile` points at the gate columns)."""
    if A_SPLITS == 0:
        return tl.load(a_tile, mask=mask, other=0.0)
    gate = tl.load(a_tile, mask=mask, other=0.0)
    up = gate
    if A_ACT_GATED:
        up = tl.load(a_tile + a_up_offset, mask=mask, other=0.0)
    for s in tl.static_range(1, A_SPLITS):
        gate += tl.load(a_tile + s * stride_a_split, mask=mask, other=0.0)
        if A_ACT_GATED:
            up += tl.load(a_tile + s * stride_a_split + a_up_offset, mask=mask, other=0.0)
    return _apply_activation(gate, up, A_ACT_KIND, ACT_LIMIT, ACT_ALPHA).to(dtype)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, w_desc, out_ptr,
    sorted_pair_ids_ptr, block_expert_ptr, num_rows_ptr,
    N, K, E, num_pairs, num_m_blocks, up_offset, w_rows_per_expert, a_up_offset,
    stride_a_m, stride_a_k, stride_a_split, stride_w_e, stride_w_n, stride_w_k, stride_out_m, stride_out_split,
    W_DESC: tl.constexpr,  # weights through a TMA descriptor over the (E * N_w, K) view, else pointers
    PER_PAIR: tl.constexpr,  # row block b holds pair b in its first row; block_expert_ptr = topk_ids
    GATHER_TOP_K: tl.constexpr,  # 0: a is in row space; k > 0: a row = pair // k
    FUSED_GATE: tl.constexpr,  # also accumulate the up columns at up_offset (gated activations)
    ACT_KIND: tl.constexpr,  # -1: no epilogue (gate and up partials side by side when FUSED_GATE); else applied
    SPLIT_K: tl.constexpr,  # programs along K (grid axis 1); > 1 stores float32 partials per slice
    A_SPLITS: tl.constexpr,  # 0: a holds rows; S > 0: a holds S float32 partials to sum and activate
    A_ACT_KIND: tl.constexpr, A_ACT_GATED: tl.constexpr,
    ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    # This program's slice of the K steps (all of them without split-K).
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    first_step = tl.program_id(1) * steps_per_split
    last_step = min(first_step + steps_per_split, k_steps)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = first_step * BLOCK_K
    a_tile = a_ptr + a_rows[:, None] * stride_a_m + (k_start + offs_k)[None, :] * stride_a_k
    w_tile = (w_ptr + expert * stride_w_e + offs_n[None, :].to(tl.int64) * stride_w_n
              + (k_start + offs_k)[:, None] * stride_w_k)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Descriptor tiles may run past this expert's N rows into the next expert (or into the up
    # half): those columns are garbage and are masked at the store. K tails are zero-filled.
    w_row = (expert * w_rows_per_expert + pid_n * BLOCK_N).to(tl.int32)
    for k in range(first_step, last_step):
        k_left = K - k * BLOCK_K
        a = _load_a(a_tile, is_real[:, None] & (offs_k[None, :] < k_left), stride_a_split, a_up_offset,
                    A_SPLITS, A_ACT_KIND, A_ACT_GATED, ACT_LIMIT, ACT_ALPHA, w_ptr.dtype.element_ty)
        w_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < N)
        if W_DESC:
            w = w_desc.load([w_row, k * BLOCK_K]).T
        else:
            w = tl.load(w_tile, mask=w_mask, other=0.0)
        acc = _dot(a, w, acc, IEEE_FP32)
        if FUSED_GATE:
            if W_DESC:
                w_up = w_desc.load([w_row + N, k * BLOCK_K]).T
            else:
                w_up = tl.load(w_tile + up_offset, mask=w_mask, other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE_FP32)
        a_tile += BLOCK_K * stride_a_k
        w_tile += BLOCK_K * stride_w_k

    out = out_ptr + tl.program_id(1) * stride_out_split + rows[:, None].to(tl.int64) * stride_out_m + offs_n[None, :]
    out_mask = is_real[:, None] & (offs_n[None, :] < N)
    if ACT_KIND >= 0:
        acc = _apply_activation(acc, acc_up, ACT_KIND, ACT_LIMIT, ACT_ALPHA)
    elif FUSED_GATE:  # split-K partials of a gated pair: [gate | up], as the next GEMM's loads expect
        tl.store(out + N, acc_up.to(out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _weight_descriptor(w: torch.Tensor, config: GemmConfig):
    """A TMA descriptor over w viewed as (E * N, K), when the config asks for one and the layout
    allows it (contiguous, 16-byte aligned rows); else None and the kernel uses pointer loads."""
    if not config.tma_weights or not w.is_contiguous() or (w.shape[2] * w.element_size()) % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [config.block_n, config.block_k])


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    layout: ExpertLayout,
    config: GemmConfig,
    *,
    gather: bool,
    activation: Activation | None = None,
    a_activation: Activation | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM in the row space of `layout`: shape (R, N), or (R, N / 2) with a gated activation.

    `a` is hidden_states, shape (T, K_in), when `gather`, else rows in layout order, shape (R, K_in).
    `w` has shape (E, N, K_in). Shapes are validated by the caller (fused_moe.fused_experts).

    Split-K (`config.split_k` = S > 1) returns float32 partial sums, shape (S, R, N), with no
    activation applied: a gated `activation` then only means the partials hold [gate | up] side
    by side; hand it on as the next call's `a_activation`. `a_activation` says `a` is such
    partials, shape (S_a, R, N_a), summed and activated as they load (K_in = N_a / 2 when gated).
    """
    if config.block_m != layout.block_m:
        raise ValueError(f"config.block_m={config.block_m} must equal the layout's block_m={layout.block_m}")
    if a_activation is not None and (gather or a.dim() != 3):
        raise ValueError("a_activation needs `a` to be split-K partials (S, R, N) in row space (gather=False)")
    E, N, K = w.shape
    split_k = config.split_k
    gated = activation is not None and activation.gated
    n_out = N // 2 if gated else N
    if split_k > 1:  # partials of every column; the activation waits for the sum
        shape, dtype, epilogue = (split_k, layout.max_rows, N), torch.float32, None
    else:
        shape, dtype, epilogue = (layout.max_rows, n_out), a.dtype, activation
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=a.device)  # [S, R, N] or [R, N_out]
    num_m_blocks = layout.max_rows // layout.block_m
    if num_m_blocks == 0 or n_out == 0:
        return out
    grid = (num_m_blocks * triton.cdiv(n_out, config.block_n), split_k)
    per_pair = layout.kind is LayoutKind.PER_PAIR
    w_desc = _weight_descriptor(w, config) or w
    block_expert = layout.topk_ids if per_pair else layout.block_expert
    sorted_pair_ids, num_rows = (block_expert, block_expert) if per_pair else (layout.sorted_pair_ids, layout.num_rows)
    a_splits = a.shape[0] if a_activation is not None else 0
    a_gated = a_activation is not None and a_activation.gated
    a_rows = a[0] if a_splits else a  # [R, N_a] or [T or R, K_in]
    params = a_activation or activation  # the one activation this launch applies, if any
    _expert_gemm_kernel[grid](
        a, w, w_desc, out,
        sorted_pair_ids, block_expert, num_rows,  # PER_PAIR reads only block_expert (the ids)
        n_out, K, E, layout.num_pairs, num_m_blocks, n_out * w.stride(1), N, K if a_gated else 0,
        a_rows.stride(0), a_rows.stride(1), a.stride(0) if a_splits else 0,
        w.stride(0), w.stride(1), w.stride(2), out.stride(-2), out.stride(0) if split_k > 1 else 0,
        W_DESC=w_desc is not w, PER_PAIR=per_pair, GATHER_TOP_K=layout.top_k if gather else 0,
        FUSED_GATE=gated, ACT_KIND=epilogue.kind.value if epilogue is not None else -1, SPLIT_K=split_k,
        A_SPLITS=a_splits, A_ACT_KIND=a_activation.kind.value if a_activation is not None else -1, A_ACT_GATED=a_gated,
        ACT_LIMIT=float(params.swiglu_limit) if params is not None else 0.0,
        ACT_ALPHA=float(params.swiglu_alpha) if params is not None else 0.0,
        IEEE_FP32=w.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def expert_gemm_torch(a: torch.Tensor, w: torch.Tensor, row_tokens: torch.Tensor, row_experts: torch.Tensor):
    """Reference: out[r] = a[row_tokens[r]] @ w[row_experts[r]].T in float32, for the given rows."""
    return torch.einsum("rk,rnk->rn", a.float()[row_tokens], w.float()[row_experts])
