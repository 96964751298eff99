"""gpt-oss (transformers' `GptOssForCausalLM`): its MoE block so far, for `from_transformers`.
The model itself (attention sinks, alternating sliding windows, MXFP4 checkpoints through
`load_model`) is still to come (issue 32)."""
from __future__ import annotations

from moe_triton.activation import Activation, ActivationKind
from moe_triton.layer import MoESpec
from moe_triton.routing import RoutingSpec

from .registry import register_block


@register_block("GptOssMLP", router="router.weight", router_bias="router.bias")
def gpt_oss_moe_spec(config) -> MoESpec:
    # top-k on the logits, then a softmax over the k selected: the renormalized softmax's weights
    routing = RoutingSpec(config.num_experts_per_tok, renormalize=True)
    activation = Activation(ActivationKind.CLAMPED_SWIGLU, float(config.swiglu_limit),
                            float(getattr(config, "swiglu_alpha", 1.702)))
    return MoESpec(config.num_local_experts, config.hidden_size, config.intermediate_size,
                   routing, activation, expert_bias=True, router_bias=True)
