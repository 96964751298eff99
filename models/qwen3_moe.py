"""Qwen3-MoE (`Qwen3MoeForCausalLM`): attention -> MoE -> LM (decoder layer and model: layers.py).
Legend: B sequences, L tokens each, H hidden, Hq/Hkv heads, D head dim, V vocabulary."""
from __future__ import annotations

import torch
from torch import nn

from moe_triton.activation import Activation
from moe_triton.layer import FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec

from .causal_lm import CausalLM
from .layers import (
    Batch,
    DecoderLayer,
    DecoderModel,
    Linear,
    QKVProjection,
    RMSNorm,
    StaticKVCache,
    attention,
    head_dim_of,
    silu_and_mul,
)
from .registry import register_block, register_model


class Qwen3MoeAttention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, head_dim_of(config)
        bias = config.attention_bias
        self.qkv_proj = QKVProjection(config.hidden_size,
                                      config.num_attention_heads * self.head_dim,
                                      config.num_key_value_heads * self.head_dim, bias)
        self.o_proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                             bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)  # per head, before rotary
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sliding_window = (config.sliding_window
                               if getattr(config, "use_sliding_window", False) else None)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: Batch,
                cache: StaticKVCache) -> torch.Tensor:
        B, L, _ = x.shape
        # [B, H*, L, D]
        q, k, v = (t.view(B, L, -1, self.head_dim).transpose(1, 2) for t in self.qkv_proj(x))
        out = attention(q, k, v, cache, self.layer, batch, self.head_dim**-0.5, self.sliding_window,
                        rotary, qk_norm=(self.q_norm, self.k_norm))  # [B, L, Hq * D]
        return self.o_proj(out)


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


@register_block("Qwen3MoeSparseMoeBlock")
def qwen3_moe_spec(config) -> MoESpec:
    routing = RoutingSpec(config.num_experts_per_tok, renormalize=config.norm_topk_prob)
    return MoESpec(config.num_experts, config.hidden_size, config.moe_intermediate_size, routing,
                   Activation.from_hidden_act(config.hidden_act))


def qwen3_moe_mlp(config, layer: int, placement: Placement) -> nn.Module:
    """The layer's MoE block, or the dense MLP of `mlp_only_layers` / non-sparse steps."""
    sparse = (layer not in config.mlp_only_layers and config.num_experts > 0
              and (layer + 1) % config.decoder_sparse_step == 0)
    return FusedMoE.from_spec(qwen3_moe_spec(config), placement) if sparse else Qwen3MoeMLP(config)


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config, placement: Placement = Placement()):
        super().__init__(config)
        self.model = DecoderModel(config, lambda i: DecoderLayer(
            config, Qwen3MoeAttention(config, i), qwen3_moe_mlp(config, i, placement)))
        self._output_head(config)
