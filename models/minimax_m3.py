"""MiniMax-M3's MoE block (`MiniMaxM3VLSparseMoeBlock`), standalone: the full model carries a
sparse-attention indexer outside this project's scope.

    out = routed_experts(x) * routed_scaling_factor + shared_experts(x)

Routing is MiniMax's sigmoid with a selection-only correction bias; experts and the shared MLP
use the clamped swiglu ((clamp(up) + 1) * g * sigmoid(alpha * g)). In captured decode
(`overlap=True`) the routed experts run on the "alt" stream and the shared experts on the stream
the block was called on; both read `x` and write fresh outputs.
"""
from __future__ import annotations

from torch import nn

from moe_triton.activation import Activation, ActivationKind, activation_torch
from moe_triton.layer import FusedMoE
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring


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


class MiniMaxM3MoeBlock(FusedMoE):
    """MiniMax-M3's MoE block: one FusedMoE with the shared MLP, loaded from transformers' names.
    transformers scales the routed output by routed_scaling_factor; the routing weights carry it
    here (the same weighted sum)."""

    renames = [
        (r"^gate\.weight$", "gate_weight"),
        (r"^gate\.e_score_correction_bias$", "e_score_correction_bias"),
        (r"^experts\.(gate_up_proj|down_proj)(_scale|_scale_inv)?$", r"\1\2"),
        (r"^experts\.input_scale$", "input_scale"),
    ]

    def __init__(self, config, placement: Placement = Placement()):
        routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID, renormalize=True, correction_bias=True,
                              routed_scaling_factor=float(config.routed_scaling_factor))
        super().__init__(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                         config.intermediate_size, routing=routing, activation=clamped_swiglu(config),
                         shared_experts=MiniMaxM3SharedMLP(config), weight_format=placement.context.experts_format(),
                         placement=placement)
