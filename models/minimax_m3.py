"""MiniMax-M3's MoE block (`MiniMaxM3VLSparseMoeBlock`) alone (its sparse-attention indexer is out
of scope): out = routed_experts(x) * routed_scaling_factor + shared_experts(x), sigmoid routing
with a selection-only correction bias, clamped swiglu ((clamp(up) + 1) * g * sigmoid(alpha * g))."""
from __future__ import annotations

from torch import nn

from moe_triton.activation import Activation, ActivationKind
from moe_triton.layer import FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring

from .layers import Linear, gated_activation
from .registry import register_block


def clamped_swiglu(config) -> Activation:
    return Activation(ActivationKind.CLAMPED_SWIGLU, float(config.swiglu_limit),
                      float(config.swiglu_alpha))


class MiniMaxM3SharedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation = clamped_swiglu(config)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.shared_intermediate_size,
                                   bias=False)
        self.down_proj = Linear(config.shared_intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.activation))


@register_block("MiniMaxM3VLSparseMoeBlock", correction_bias="gate.e_score_correction_bias",
                shared_experts="shared_experts")
def minimax_m3_moe_spec(config) -> MoESpec:
    # transformers scales the routed output; the same factor on the routing weights is the same sum
    scaling = float(config.routed_scaling_factor)
    routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID, renormalize=True,
                          correction_bias=True, routed_scaling_factor=scaling)
    return MoESpec(config.num_local_experts, config.hidden_size, config.intermediate_size, routing,
                   clamped_swiglu(config), shared_intermediate_size=config.shared_intermediate_size)


class MiniMaxM3MoeBlock(FusedMoE):
    renames = ()  # loaded as a model of its own: FusedMoE's checkpoint_renames are all it needs

    def __init__(self, config, placement: Placement = Placement()):
        spec = minimax_m3_moe_spec(config)
        super().__init__(**spec.layer_args(), shared_experts=MiniMaxM3SharedMLP(config),
                         placement=placement)
