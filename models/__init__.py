"""MoE model families on the expert layer, installed as `moe_triton.models`.

    registry.py     architecture name -> family class, transformers block class -> family spec;
                    load_model(path) for a checkpoint directory, from_transformers(block)
    checkpoint.py   safetensors reading, per-expert -> fused expert tensors, q/k/v -> one qkv_proj,
                    strict name/shape checks
    fp8.py          FP8 checkpoints: expert scales into FusedMoE's layout, other FP8 linears dequantized
    layers.py       RMSNorm, rotary, the fused QKV projection, static KV cache, attention (SDPA prefill,
                    decode_attention.py decode)
    decode_attention.py  Triton decode attention reading the cache in place (split + combine kernels)
    rms_norm.py     RMSNorm in one Triton kernel
    rotary.py       rotary embedding (rotate-half / interleaved, partial; optionally after a per-head
                    RMSNorm) in one Triton kernel; the decode K/V cache write with k's rotation in it
    causal_lm.py    prefill, decode step, greedy generate (decode through graphs/ on CUDA)
    qwen3_moe.py    Qwen3MoeForCausalLM
    cohere2_moe.py  Cohere2MoeForCausalLM (parallel block; attention || MLP and shared || routed overlap)
    minimax_m2.py   MiniMaxM2ForCausalLM (sigmoid routing with correction bias, partial rotary)
    minimax_m3.py   MiniMax-M3's MoE block (shared || routed, clamped swiglu), standalone
    nemotron_h.py   NemotronH's MoE block (relu^2, grouped top-k, latent projections), standalone
"""
from . import cohere2_moe, minimax_m2, minimax_m3, nemotron_h, qwen3_moe  # noqa: F401  (registers)
from .registry import (
    MODELS,
    default_dtype,
    from_transformers,
    load_model,
    model_class,
    register_model,
)

__all__ = ["MODELS", "default_dtype", "from_transformers", "load_model", "model_class",
           "register_model"]
