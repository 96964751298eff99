"""MiniMax-M3's MoE block (`MiniMaxM3VLSparseMoeBlock`), standalone: the full model carries a
sparse-attention indexer outside this project's scope.

    out = routed_experts(x) * routed_scaling_factor + shared_experts(x)

Routing is MiniMax's sigmoid with a selection-only correction bias; experts and the shared MLP
use the clamped swiglu ((clamp(up) + 1) * g * sigmoid(alpha * g)). In captured decode
(`batch.overlap`) the routed experts run on the "alt" stream and the shared experts on the stream
the block was called on; both read `x` and write fresh outputs.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_triton import FusedMoE, RoutingSpec, Scoring
from moe_triton.activation import Activation, ActivationKind, activation_torch

from .layers import Batch, ExpertsOptions, shared_and_routed


def clamped_swiglu(config) -> Activation:
    return Activation(ActivationKind.CLAMPED_SWIGLU, float(config.swiglu_limit), float(config.swiglu_alpha))


class MiniMaxM3SharedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation = clamped_swiglu(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.shared_intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.shared_intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(activation_torch(self.gate_up_proj(x), self.activation).to(x.dtype))


class MiniMaxM3MoeBlock(nn.Module):
    # transformers' names -> ours: the router lives inside our experts layer
    renames = [
        (r"^gate\.weight$", "experts.gate_weight"),
        (r"^gate\.e_score_correction_bias$", "experts.e_score_correction_bias"),
    ]

    def __init__(self, config, experts: ExpertsOptions = ExpertsOptions()):
        super().__init__()
        routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID, renormalize=True)
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, routing=routing, activation=clamped_swiglu(config),
                                correction_bias=True, routed_scaling_factor=float(config.routed_scaling_factor),
                                **experts.fused_moe_kwargs())
        self.shared_experts = MiniMaxM3SharedMLP(config)

    def forward(self, x: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:
        """x (..., H) -> (..., H)."""
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        shared, routed = shared_and_routed(self.shared_experts, self.experts.routed_experts, flat, batch)
        return (routed + shared).view(x.shape)
