"""The expert layer's entry points: `fused_experts` (functional) and `FusedMoE` (module).

    hidden_states [T, H], topk_ids [T, K], topk_weights [T, K]
      -> expand      (expand.py)       pairs sorted by expert, block-padded
      -> expert GEMM (expert_gemm.py)  gather + w13 + activation epilogue   [R, I]
      -> expert GEMM (expert_gemm.py)  w2                                   [R, H]
    (decode with split-K: float32 partials [S, R, 2I] / [S, R, H] instead, summed where the next
     stage loads them: the activation moves into the second GEMM's loads)
      -> finalize    (finalize.py)     weighted un-permute into a fresh     [T, H]

Every argument is checked here, before any kernel launches.
"""
from __future__ import annotations

import torch

from .activation import SILU_AND_MUL, Activation, activate
from .config import MoEConfig, choose_config
from .expand import LayoutKind, expand, per_pair_layout
from .expert_gemm import expert_gemm
from .finalize import finalize
from .platform import triton_can_run_on

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_experts_args(hidden_states, w13, w2, topk_ids, topk_weights, activation: Activation):
    """Validate the layer's inputs; returns (T, H, E, I, K). Raises ValueError naming the argument."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D (T, H), got shape {tuple(hidden_states.shape)}; "
                         "flatten leading dimensions with hidden_states.reshape(-1, H)")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"hidden_states dtype {hidden_states.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    T, H = hidden_states.shape
    device, dtype = hidden_states.device, hidden_states.dtype
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D (E, N, K_in), got shape {tuple(w.shape)}")
        if w.dtype != dtype or w.device != device:
            raise ValueError(f"{name} is {w.dtype} on {w.device} but hidden_states is {dtype} on {device}; "
                             f"cast/move {name} to match")
    E = w13.shape[0]
    if E <= 0:
        raise ValueError(f"w13 has E={E} experts; the layer needs at least one")
    if w13.shape[2] != H:
        raise ValueError(f"w13 has input size {w13.shape[2]} but hidden_states has H={H}")
    I = w13.shape[1] // 2 if activation.gated else w13.shape[1]
    if activation.gated and w13.shape[1] % 2:
        raise ValueError(f"w13 has {w13.shape[1]} rows; a gated activation needs [gate; up] = 2I rows")
    if w2.shape != (E, H, I):
        raise ValueError(f"w2 must have shape (E, H, I) = {(E, H, I)}, got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a 2-D int32/int64 tensor (T, K), got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    K = topk_ids.shape[1]
    if topk_ids.shape[0] != T or topk_ids.device != device:
        raise ValueError(f"topk_ids must have {T} rows on {device}, got {tuple(topk_ids.shape)} on {topk_ids.device}")
    if not 1 <= K <= E:
        raise ValueError(f"top_k (topk_ids.shape[1]) must be in [1, E={E}], got {K}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be a floating tensor of shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    if topk_weights.device != device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, hidden_states on {device}")
    return T, H, E, I, K


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: Activation = SILU_AND_MUL,
    config: MoEConfig | None = None,
    fuse_activation: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert layer on Triton kernels: a fresh output of shape (T, H).

    hidden_states (T, H); w13 (E, 2I, H) [gate; up] or (E, I, H) for a non-gated activation;
    w2 (E, H, I); topk_ids (T, K) int32/int64, where an id outside [0, E) is *filtered*: that
    (token, slot) pair contributes nothing (transformers' expert-parallel sentinel is E, other
    engines use -1; both work); topk_weights (T, K). `config` overrides the launch configuration;
    `fuse_activation=False` runs the standalone activation kernel between the GEMMs.
    """
    T, H, E, I, K = check_experts_args(hidden_states, w13, w2, topk_ids, topk_weights, activation)
    if not triton_can_run_on(hidden_states.device):
        raise ValueError(f"Triton kernels cannot run on {hidden_states.device}: move the tensors to a CUDA "
                         "device, set TRITON_INTERPRET=1 before importing moe_triton, or use the torch backend")
    if T == 0:
        return torch.empty(0, H, dtype=hidden_states.dtype, device=hidden_states.device) if out is None else out
    config = config or choose_config(T, K, E, H, I, hidden_states.device, hidden_states.dtype)
    if config.up.split_k > 1 and not fuse_activation:
        raise ValueError("fuse_activation=False runs the standalone activation on the first GEMM's output, but "
                         f"config.up.split_k={config.up.split_k} leaves partial sums for the second GEMM to "
                         "activate: use split_k=1 for the first GEMM, or fuse_activation=True")
    if config.layout is LayoutKind.PER_PAIR:
        layout = per_pair_layout(topk_ids, E, config.block_m)  # decode: no sort, no launch
    else:
        layout = expand(topk_ids, E, config.block_m)
    if fuse_activation:  # a split first GEMM leaves float32 partials, [S, R, 2I], for the second to activate
        h = expert_gemm(hidden_states, w13, layout, config.up, gather=True, activation=activation)  # [R, I]
    else:
        gate_up = expert_gemm(hidden_states, w13, layout, config.up, gather=True)  # [R, 2I] or [R, I]
        h = activate(gate_up, activation)  # [R, I]
    pending = activation if config.up.split_k > 1 else None
    y = expert_gemm(h, w2, layout, config.down, gather=False, a_activation=pending)  # [R, H] or [S, R, H] fp32
    return finalize(y, topk_weights, layout, out=out, out_dtype=hidden_states.dtype)  # [T, H]
