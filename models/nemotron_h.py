"""NemotronH's MoE block (`NemotronHMoE`), standalone: the full model carries Mamba mixers
outside this project's scope.

    out = fc2(experts(fc1(x))) + shared_experts(x)

Non-gated relu^2 experts (`up_proj` [E, I, H']), grouped top-k routing in float32 with a
correction bias and `routed_scaling_factor`, optional latent projections (H -> H' -> H). In
captured decode (`overlap=True`) the routed path runs on "alt" and the shared MLP on the calling stream.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_triton.activation import Activation
from moe_triton.layer import FusedMoE
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring


class NemotronHMLP(nn.Module):
    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHMoeBlock(FusedMoE):
    """NemotronH's MoE block: one FusedMoE with the shared MLP, loaded from transformers' names."""

    renames = [
        (r"^gate\.weight$", "gate_weight"),
        (r"^gate\.e_score_correction_bias$", "e_score_correction_bias"),
        (r"^experts\.up_proj(_scale|_scale_inv)?$", r"gate_up_proj\1"),  # non-gated: w13 holds up only
        (r"^experts\.down_proj(_scale|_scale_inv)?$", r"down_proj\1"),
        (r"^experts\.input_scale$", "input_scale"),
        (r"^fc1_latent_proj\.", "expert_input_proj."),
        (r"^fc2_latent_proj\.", "expert_output_proj."),
    ]

    def __init__(self, config, placement: Placement = Placement()):
        latent = config.moe_latent_size
        routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID, renormalize=config.norm_topk_prob,
                              n_group=config.n_group, topk_group=config.topk_group,
                              routed_scaling_factor=float(config.routed_scaling_factor), correction_bias=True,
                              router_in_float32=True)
        super().__init__(
            config.n_routed_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
            routing=routing, activation=Activation.from_hidden_act(config.mlp_hidden_act),
            shared_experts=NemotronHMLP(config, config.moe_shared_expert_intermediate_size),
            expert_input_proj=nn.Linear(config.hidden_size, latent, bias=config.mlp_bias) if latent else None,
            expert_output_proj=nn.Linear(latent, config.hidden_size, bias=config.mlp_bias) if latent else None,
            weight_format=placement.context.experts_format(), placement=placement,
        )
