"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): attention -> MoE -> LM (decoder layer and model: layers.py).
Unlike Qwen3-MoE: q/k RMSNorm over all heads at once, partial rotary, and sigmoid routing whose
`e_score_correction_bias` steers selection only (weights: the unbiased scores, renormalised)."""
from __future__ import annotations

from torch import nn

from moe_triton.activation import Activation
from moe_triton.layer import FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.routing import RoutingSpec, Scoring

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
)
from .registry import register_block, register_model


class MiniMaxM2Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, head_dim_of(config)
        q_size, kv_size = (config.num_attention_heads * self.head_dim,
                           config.num_key_value_heads * self.head_dim)
        self.qkv_proj = QKVProjection(config.hidden_size, q_size, kv_size, bias=False)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(q_size, config.rms_norm_eps)  # over all heads, before the head split
        self.k_norm = RMSNorm(kv_size, config.rms_norm_eps)

    def forward(self, x, rotary, batch: Batch, cache: StaticKVCache):
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = self.q_norm(q).view(B, L, -1, self.head_dim).transpose(1, 2)  # [B, Hq, L, D]
        k = self.k_norm(k).view(B, L, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        v = v.view(B, L, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        # rotary is partial here: the first D_rot dims of each head
        return self.o_proj(attention(q, k, v, cache, self.layer, batch, self.head_dim**-0.5,
                                     rotary=rotary))


@register_block("MiniMaxM2SparseMoeBlock", correction_bias="e_score_correction_bias")
def minimax_m2_moe_spec(config) -> MoESpec:
    routing = RoutingSpec(config.num_experts_per_tok, Scoring.SIGMOID, renormalize=True,
                          correction_bias=True)
    return MoESpec(config.num_local_experts, config.hidden_size, config.intermediate_size, routing,
                   Activation.from_hidden_act(config.hidden_act))


@register_model("MiniMaxM2ForCausalLM")
class MiniMaxM2ForCausalLM(CausalLM):
    renames = [
        (r"\.block_sparse_moe\.", ".mlp."),  # the Hub layout (Mixtral-style w1 / w3 / w2 experts)
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),  # and FP8's .weight_scale_inv
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    ]

    def __init__(self, config, placement: Placement = Placement()):
        super().__init__(config)
        spec = minimax_m2_moe_spec(config)
        self.model = DecoderModel(config, lambda i: DecoderLayer(
            config, MiniMaxM2Attention(config, i), FusedMoE.from_spec(spec, placement)))
        self._output_head(config)
