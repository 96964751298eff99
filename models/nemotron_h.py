"""NemotronH's MoE block (`NemotronHMoE`) alone (its Mamba mixers are out of scope):
out = fc2(experts(fc1(x))) + shared_experts(x), non-gated relu^2 experts (`up_proj` [E, I, H']),
grouped top-k in float32 with a correction bias, optional latent projections (H -> H' -> H)."""
from __future__ import annotations

import torch
from torch import nn

from moe_triton.activation import Activation
from moe_triton.layer import FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring

from .layers import Linear
from .registry import register_block


class NemotronHMLP(nn.Module):
    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.up_proj = Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


@register_block("NemotronHMoE", correction_bias="gate.e_score_correction_bias",
                shared_experts="shared_experts", expert_input_proj="fc1_latent_proj",
                expert_output_proj="fc2_latent_proj")
def nemotron_h_moe_spec(config) -> MoESpec:
    routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID,
                          renormalize=config.norm_topk_prob, n_group=config.n_group,
                          topk_group=config.topk_group, correction_bias=True,
                          router_in_float32=True,
                          routed_scaling_factor=float(config.routed_scaling_factor))
    return MoESpec(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                   routing, Activation.from_hidden_act(config.mlp_hidden_act),
                   shared_intermediate_size=config.moe_shared_expert_intermediate_size,
                   latent_size=config.moe_latent_size)


class NemotronHMoeBlock(FusedMoE):
    checkpoint_renames = FusedMoE.checkpoint_renames + (
        # non-gated: w13 holds up only
        (r"^experts\.up_proj(_scale|_scale_inv)?$", r"gate_up_proj\1"),
        (r"^fc1_latent_proj\.", "expert_input_proj."),
        (r"^fc2_latent_proj\.", "expert_output_proj."),
    )
    renames = ()  # loaded as a model of its own: its checkpoint_renames are all it needs

    def __init__(self, config, placement: Placement = Placement()):
        spec = nemotron_h_moe_spec(config)
        latent, bias = spec.latent_size, config.mlp_bias
        super().__init__(
            **spec.layer_args(), placement=placement,
            shared_experts=NemotronHMLP(config, spec.shared_intermediate_size),
            expert_input_proj=Linear(spec.hidden_size, latent, bias=bias) if latent else None,
            expert_output_proj=Linear(latent, spec.hidden_size, bias=bias) if latent else None,
        )
