"""moe-triton: a Mixture-of-Experts expert layer on Triton kernels, stage by stage.

    router logits [T, E]
      -> routing      (routing.py)      top-k expert ids [T, K] int32, weights [T, K] float32
    hidden_states [T, H], ids, weights, ExpertWeights (weights.py)
      (FP8 experts: quantize.py quantizes hidden_states once per token)
      -> expand       (expand.py)       (token, slot) pairs sorted by expert, block-padded
      -> expert GEMM  (expert_gemm.py)  gathered rows @ w13 [E, 2I, H], the activation
                                        (activation.py) in its epilogue: [R, I]
      -> expert GEMM  (expert_gemm.py)  @ w2 [E, H, I]
      -> finalize     (finalize.py)     weighted un-permute into a fresh [T, H]
    (opt-in for a few tokens: decode.py runs the whole layer in one persistent launch)

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K (token, slot) pairs,
R rows after expand; a GEMM computes N output columns over a contraction width C.

`pipeline.py` runs it, planned once per call signature (reference: `reference.py`);
`with batch_invariant():` (invariance.py) makes each token's output independent of its batch;
`layer.py`'s `FusedMoE` calls a runner the resolver picks once per layer. Importing registers
the "moe_triton" experts in transformers."""
from .activation import SILU_AND_MUL, Activation, ActivationKind, activate, activation_torch
from .config import DecodeConfig, GemmConfig, MoEConfig, choose_config, decode_config
from .expand import ExpertLayout, LayoutKind, expand_torch, per_pair_layout
from .finalize import finalize_torch
from .integrations.transformers import register_experts_implementation
from .invariance import batch_invariant
from .layer import FusedMoE, MoESpec, SharedCombination
from .models import from_transformers
from .pipeline import fused_experts, run_experts
from .placement import Placement
from .platform import Platform, detect_platform
from .quantize import quantize_fp8
from .reference import fused_experts_torch
from .routing import (
                      RoutingSpec,
                      Scoring,
                      SelectOn,
                      biased_sigmoid_topk,
                      grouped_topk,
                      route,
                      route_torch,
                      router_logits,
                      softmax_topk,
                      topk_sigmoid,
                      topk_softmax,
)
from .runners import ExpertBackend, ModelContext, Resolution, pad_experts, resolve
from .weights import ExpertWeights, Fp8Scaling, WeightFormat

register_experts_implementation()

__all__ = [
    "SILU_AND_MUL", "Activation", "ActivationKind", "activate", "activation_torch",
    "GemmConfig", "MoEConfig", "DecodeConfig", "choose_config", "decode_config",
    "ExpertLayout", "LayoutKind", "expand_torch", "per_pair_layout", "finalize_torch",
    "fused_experts", "run_experts", "fused_experts_torch", "from_transformers", "ExpertWeights",
    "WeightFormat", "Fp8Scaling", "quantize_fp8", "batch_invariant",
    "ExpertBackend", "FusedMoE", "MoESpec", "SharedCombination", "ModelContext", "Placement",
    "Resolution", "resolve", "pad_experts", "Platform", "detect_platform",
    "RoutingSpec", "Scoring", "SelectOn", "route", "route_torch", "router_logits",
    "softmax_topk", "topk_softmax", "topk_sigmoid", "biased_sigmoid_topk", "grouped_topk",
]
