"""gpt-oss (`GptOssForCausalLM`): attention with a sink logit per head, layers alternating between
a sliding window and full attention (`layer_types`), YaRN rotary, and a MoE block whose router
and experts have biases, experts in MXFP4 as published (or bf16), gate/up rows interleaved.
Legend: B sequences, L tokens each, H hidden, Hq/Hkv heads, D head dim, E experts, I their width."""
from __future__ import annotations

import re

import torch
from torch import nn

from moe_triton.activation import Activation, ActivationKind
from moe_triton.layer import EXPERT_TENSORS, FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec
from moe_triton.weights import MXFP4_GROUP, NATIVE, ExpertWeights, WeightFormat

from .causal_lm import CausalLM
from .layers import (
    Batch,
    DecoderLayer,
    DecoderModel,
    Linear,
    QKVProjection,
    StaticKVCache,
    attention,
    head_dim_of,
)
from .registry import register_block, register_model

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssAttention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, head_dim_of(config)
        heads, bias = config.num_attention_heads, config.attention_bias
        self.qkv_proj = QKVProjection(config.hidden_size, heads * self.head_dim,
                                      config.num_key_value_heads * self.head_dim, bias)
        self.o_proj = Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(heads))  # a logit per head, softmax's denominator
        sliding = config.layer_types[layer] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: Batch,
                cache: StaticKVCache) -> torch.Tensor:
        B, L, _ = x.shape
        # [B, H*, L, D]
        q, k, v = (t.view(B, L, -1, self.head_dim).transpose(1, 2) for t in self.qkv_proj(x))
        out = attention(q, k, v, cache, self.layer, batch, self.head_dim**-0.5,
                        self.sliding_window, rotary, sinks=self.sinks)  # [B, L, Hq * D]
        return self.o_proj(out)


@register_block("GptOssMLP", router="router.weight", router_bias="router.bias")
def gpt_oss_moe_spec(config) -> MoESpec:
    # top-k on the logits, then a softmax over the k selected: the renormalized softmax's weights
    routing = RoutingSpec(config.num_experts_per_tok, renormalize=True)
    activation = Activation(ActivationKind.CLAMPED_SWIGLU, float(config.swiglu_limit),
                            float(getattr(config, "swiglu_alpha", 1.702)))
    return MoESpec(config.num_local_experts, config.hidden_size, config.intermediate_size,
                   routing, activation, expert_bias=True, router_bias=True)


# the experts' tensors as published: MXFP4 blocks [E, N, C / 32, 16] and E8M0 scales
# [E, N, C / 32] (transformers' Mxfp4HfQuantizer reads these), or transformers' dense GptOssExperts
# [E, C, N]; biases [E, N]; gate/up rows (and their biases) interleaved [g0, u0, g1, u1, ...]
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                            r"(?P<kind>_blocks|_scales|_bias|)$")


def gpt_oss_experts(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The published expert tensors -> FusedMoE's checkpoint names and layout ([gate; up] rows,
    [E, N, C], MXFP4 packed [E, N, C / 2]), each checked against the config, naming it."""
    E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
    out, layers = {}, {}
    for name, tensor in tensors.items():
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            out[name] = tensor
            continue
        N, C = (2 * I, H) if match["proj"] == "gate_up_proj" else (H, I)
        expected = {"_blocks": ((E, N, C // MXFP4_GROUP, MXFP4_GROUP // 2), False),
                    "_scales": ((E, N, C // MXFP4_GROUP), False), "_bias": ((E, N), True),
                    "": ((E, C, N), True)}[match["kind"]]
        if (tuple(tensor.shape), tensor.dtype.is_floating_point) != expected:
            kind = "a float tensor" if expected[1] else "a uint8 tensor"
            raise ValueError(f"tensor {name} is a {tensor.dtype} tensor of shape "
                             f"{tuple(tensor.shape)}; gpt-oss's config (E={E}, H={H}, I={I}) "
                             f"gives {kind} of shape {expected[0]}")
        layers.setdefault(match["prefix"], {})[match["proj"] + match["kind"]] = tensor
    for prefix, parts in layers.items():
        out.update(_fused_layer(prefix, parts))
    return out


def _fused_layer(prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mxfp4 = any(name.endswith(("_blocks", "_scales")) for name in parts)
    weights = ("gate_up_proj_blocks", "down_proj_blocks") if mxfp4 else ("gate_up_proj",
                                                                         "down_proj")
    wanted = weights + (("gate_up_proj_scales", "down_proj_scales") if mxfp4 else ())
    wanted += ("gate_up_proj_bias", "down_proj_bias")
    missing = [name for name in wanted if name not in parts]
    if missing:
        raise ValueError(f"missing tensor {prefix}.{missing[0]} (gpt-oss's experts load "
                         f"together: {', '.join(wanted)})")
    if mxfp4:  # the 16 bytes of each 32-wide group are consecutive: [E, N, C / 2]
        w13, w2 = (parts[name].flatten(2) for name in weights)
        scales = dict(w13_scale=parts["gate_up_proj_scales"], w2_scale=parts["down_proj_scales"])
    else:  # transformers' [E, C, N] storage -> [E, N, C]
        w13, w2 = (parts[name].transpose(1, 2) for name in weights)
        scales = {}
    fmt = WeightFormat.mxfp4() if mxfp4 else NATIVE
    experts = ExpertWeights.from_checkpoint(w13, w2, fmt, interleaved=True,
                                            w13_bias=parts["gate_up_proj_bias"],
                                            w2_bias=parts["down_proj_bias"], **scales)
    fused = {name: getattr(experts, field) for name, field in EXPERT_TENSORS.items()}
    return {f"{prefix}.{name}": tensor.contiguous() for name, tensor in fused.items()
            if tensor is not None}


def check_layer_types(config) -> None:
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json's layer_types must give each of the num_hidden_layers="
                         f"{config.num_hidden_layers} layers one of {LAYER_TYPES}, got {types}")


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(CausalLM):
    renames = [(r"\.mlp\.router\.", ".mlp.gate.")]  # FusedMoE's router, under its usual name

    def __init__(self, config, placement: Placement = Placement()):
        check_layer_types(config)
        super().__init__(config)
        spec = gpt_oss_moe_spec(config)
        self.model = DecoderModel(config, lambda i: DecoderLayer(
            config, GptOssAttention(config, i), FusedMoE.from_spec(spec, placement)))
        self._output_head(config)

    def checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return gpt_oss_experts(tensors, self.config)
