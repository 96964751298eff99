"""The float32 torch reference of the expert layer (forward and backward): a per-expert loop
sharing no code with the Triton path but the activation's torch functions."""
from __future__ import annotations

import torch

from .activation import SILU_AND_MUL, Activation, activation_backward_torch, activation_torch
from .weights import ExpertWeights


def fused_experts_torch(
    hidden_states: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gated, [E, I, H] non-gated
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]; ids outside [0, E) are filtered and add nothing
    topk_weights: torch.Tensor,  # [T, K]
    *,
    activation: Activation = SILU_AND_MUL,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] or [E, I]: added before the activation
    w2_bias: torch.Tensor | None = None,  # [E, H]: added before the routing weight
) -> torch.Tensor:
    x = hidden_states.float()
    out = torch.zeros_like(x)  # [T, H]
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[e].float().T  # [n, 2I]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].float()
        y = activation_torch(gate_up, activation) @ w2[e].float().T  # [n, H]
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out


def fused_experts_backward_torch(
    grad_out: torch.Tensor,  # [T, H], the gradient of the layer's output
    hidden_states: torch.Tensor,  # [T, H]
    weights: ExpertWeights,
    topk_ids: torch.Tensor,  # [T, K]; filtered ids get no gradient and pass none on
    topk_weights: torch.Tensor,  # [T, K]
    *,
    activation: Activation = SILU_AND_MUL,
    needs: tuple[bool, ...] = (True,) * 6,
) -> tuple[torch.Tensor | None, ...]:
    """(dx, dw13, dw2, d topk_weights, d w13_bias, d w2_bias) in the inputs' dtypes, None where
    `needs` says no or there is no such tensor; quantized (FP8, MXFP4) weights: through their
    dequantized values, no gradient (activation quantization: identity)."""
    T, K = topk_ids.shape
    E = weights.num_experts
    x, dout = hidden_states.float(), grad_out.float()  # [T, H]
    dx = torch.zeros_like(x, memory_format=torch.contiguous_format) if needs[0] else None  # [T, H]
    native = not weights.format.quantized
    dw13 = weights.w13.new_zeros(weights.w13.shape) if needs[1] and native else None  # [E, 2I, H]
    dw2 = weights.w2.new_zeros(weights.w2.shape) if needs[2] and native else None  # [E, H, I]
    dscale = x.new_zeros(T, K) if needs[3] else None  # [T, K]
    b13, b2 = weights.w13_bias, weights.w2_bias
    db13 = x.new_zeros(b13.shape) if needs[4] and b13 is not None else None  # [E, 2I]
    db2 = x.new_zeros(b2.shape) if needs[5] and b2 is not None else None  # [E, H]
    ids = topk_ids.reshape(-1).long()  # [T * K]
    expert = torch.where((ids >= 0) & (ids < E), ids, E)  # [T * K], E: filtered
    pairs = torch.argsort(expert, stable=True)  # [T * K], grouped by expert, filtered last
    counts = torch.bincount(expert, minlength=E + 1).tolist()  # one host read for the whole layer
    for e, group in enumerate(pairs.split(counts)[:E]):
        if group.numel() == 0:
            continue
        tokens, slots = group // K, group % K  # [n]
        if native:
            w13, w2 = weights.w13[e].float(), weights.w2[e].float()  # [2I, H], [H, I]
        else:
            w13, w2 = (w[0] for w in weights.expert(e).dequantized())  # [2I, H], [H, I] float32
        xe = x[tokens]  # [n, H]
        gate_up = xe @ w13.T  # [n, 2I]
        if b13 is not None:
            gate_up = gate_up + b13[e].float()
        h = activation_torch(gate_up, activation)  # [n, I]
        de = dout[tokens]  # [n, H]
        if dscale is not None:
            y = h @ w2.T if b2 is None else h @ w2.T + b2[e].float()  # [n, H]
            dscale[tokens, slots] = (de * y).sum(dim=1)  # [n]
        dy = de * topk_weights[tokens, slots].float()[:, None]  # [n, H]
        if dw2 is not None:
            dw2[e] = dy.T @ h  # [H, I]
        if db2 is not None:
            db2[e] = dy.sum(dim=0)  # [H]
        dgate_up = activation_backward_torch(gate_up, dy @ w2, activation)  # [n, 2I]
        if dw13 is not None:
            dw13[e] = dgate_up.T @ xe  # [2I, H]
        if db13 is not None:
            db13[e] = dgate_up.sum(dim=0)  # [2I]
        if dx is not None:
            dx.index_add_(0, tokens, dgate_up @ w13)  # [n, H]
    return (None if dx is None else dx.to(hidden_states.dtype), dw13, dw2,
            None if dscale is None else dscale.to(topk_weights.dtype),
            None if db13 is None else db13.to(b13.dtype), None if db2 is None else db2.to(b2.dtype))
