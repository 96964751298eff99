"""Cohere2-MoE / Command-A-Plus (`Cohere2MoeForCausalLM`): y = x + attn(norm(x)) + mlp(norm(x)).
In captured decode (`batch.overlap`) the MLP runs on "alt_mlp" beside attention, the routed experts
on "alt" beside the shared ones: each branch reads its input and writes fresh outputs (the expert
layer is inplace-free). Prefill stays serial: a prefill chunk fills the GPU already."""
from __future__ import annotations

import torch
from torch import nn

from moe_triton.activation import Activation
from moe_triton.graphs import run_branches
from moe_triton.layer import FusedMoE, MoESpec, SharedCombination
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring, SelectOn

from .causal_lm import CausalLM
from .layers import (
    Batch,
    Linear,
    QKVProjection,
    RMSNorm,
    RotaryEmbedding,
    StaticKVCache,
    attention,
    head_dim_of,
    silu_and_mul,
)
from .registry import register_block, register_model


class Cohere2MoeLayerNorm(nn.Module):
    """Bias-free LayerNorm in float32, as Cohere's reference computes it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype, x = x.dtype, x.float()
        x = ((x - x.mean(-1, keepdim=True))
             * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + self.eps))
        return (self.weight.float() * x).to(dtype)


def norm(config) -> nn.Module:
    if config.rms_norm_eps is not None:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)
    return Cohere2MoeLayerNorm(config.hidden_size, config.layer_norm_eps)


class Cohere2MoeAttention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, head_dim_of(config)
        sliding = config.layer_types[layer] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        dense_prefix = (config.mlp_layer_types[layer] == "dense"
                        and config.prefix_dense_sliding_window_pattern == 1)
        self.use_rope = sliding or dense_prefix  # global layers are NoPE, unless a dense prefix
        bias = config.attention_bias
        self.qkv_proj = QKVProjection(config.hidden_size,
                                      config.num_attention_heads * self.head_dim,
                                      config.num_key_value_heads * self.head_dim, bias)
        self.o_proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                             bias=bias)

    def forward(self, x, rotary, batch: Batch, cache: StaticKVCache):
        B, L, _ = x.shape
        # [B, H*, L, D]
        q, k, v = (t.view(B, L, -1, self.head_dim).transpose(1, 2) for t in self.qkv_proj(x))
        # Cohere rotates interleaved pairs in float32 and rounds once, as the kernels do
        out = attention(q, k, v, cache, self.layer, batch, self.head_dim**-0.5, self.sliding_window,
                        rotary if self.use_rope else None, interleaved=True)
        return self.o_proj(out)  # [B, L, H]


class Cohere2MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, overlap: bool = False):
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


@register_block("Cohere2MoeSparseMoeBlock", shared_experts="shared_experts")
def cohere2_moe_spec(config) -> MoESpec:
    if config.shared_expert_combination_strategy not in ("sum", "average"):
        raise ValueError("shared_expert_combination_strategy must be 'sum' or 'average', "
                         f"got {config.shared_expert_combination_strategy!r}")
    scoring = Scoring.SOFTMAX if config.expert_selection_fn == "softmax" else Scoring.SIGMOID
    routing = RoutingSpec(config.num_experts_per_tok, scoring, SelectOn.LOGITS,
                          renormalize=scoring is Scoring.SIGMOID and config.norm_topk_prob)
    return MoESpec(config.num_experts, config.hidden_size, config.intermediate_size, routing,
                   Activation.from_hidden_act(config.hidden_act),
                   shared_intermediate_size=config.intermediate_size * config.num_shared_experts,
                   shared_combination=SharedCombination(config.shared_expert_combination_strategy))


def cohere2_moe_block(config, placement: Placement) -> FusedMoE:
    spec = cohere2_moe_spec(config)
    size = spec.shared_intermediate_size
    shared = Cohere2MoeMLP(config, size) if size else None
    return FusedMoE.from_spec(spec, placement, shared_experts=shared)


class Cohere2MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, placement: Placement):
        super().__init__()
        self.self_attn = Cohere2MoeAttention(config, layer)
        dense = config.mlp_layer_types[layer] == "dense"
        self.mlp = (Cohere2MoeMLP(config, config.prefix_dense_intermediate_size) if dense
                    else cohere2_moe_block(config, placement))
        self.input_layernorm = norm(config)

    def forward(self, x, rotary, batch: Batch, cache: StaticKVCache):
        h = self.input_layernorm(x)
        if batch.overlap:  # decode: the MLP branch on "alt_mlp" while attention runs here
            attn, mlp = run_branches(lambda: self.self_attn(h, rotary, batch, cache),
                                     lambda: self.mlp(h, overlap=True), role="alt_mlp")
        else:
            attn, mlp = self.self_attn(h, rotary, batch, cache), self.mlp(h)
        return x + attn + mlp


class Cohere2MoeModel(nn.Module):
    def __init__(self, config, placement: Placement):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Cohere2MoeDecoderLayer(config, i, placement)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm(config)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))

    def forward(self, input_ids, batch: Batch, cache: StaticKVCache):
        x = self.embed_tokens(input_ids)  # [B, L, H]
        rotary = self.rotary_emb(batch.positions, x.dtype, interleaved=True)
        for layer in self.layers:
            x = layer(x, rotary, batch, cache)
        return self.norm(x)


@register_model("Cohere2MoeForCausalLM")
class Cohere2MoeForCausalLM(CausalLM):
    def __init__(self, config, placement: Placement = Placement()):
        super().__init__(config)
        self.model = Cohere2MoeModel(config, placement)
        self._output_head(config)
