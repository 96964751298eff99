"""moe-triton: a Mixture-of-Experts expert layer on Triton kernels, stage by stage.

    router logits [T, E]
      -> routing      (routing.py)      top-k expert ids [T, K] int32, weights [T, K] float32
    hidden_states [T, H], ids, weights
      -> expand       (expand.py)       (token, slot) pairs sorted by expert, block-padded
      -> expert GEMM  (expert_gemm.py)  gather rows + w13 [E, 2I, H] + activation epilogue
      -> activation   (activation.py)   silu/gelu-and-mul, relu^2, clamped swiglu (also standalone)
      -> expert GEMM  (expert_gemm.py)  w2 [E, H, I]
      -> finalize     (finalize.py)     weighted un-permute into a fresh [T, H]

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, R rows after expand.
`reference.py` holds the float32 torch reference of the whole layer; `layer.py` the `FusedMoE`
module; importing the package registers `experts_implementation="moe_triton"` in transformers.

Which backend runs the experts (triton, torch, or a FlashInfer path) is decided once per layer
by `backends/resolver.py` and kept as `layer.resolution`; `backends/` also holds the
per-architecture rules, alignment padding, the FlashInfer paths and the temperature-0 probe.
"""
from .activation import SILU_AND_MUL, Activation, ActivationKind, activate, activation_torch
from .config import GemmConfig, MoEConfig, choose_config
from .expand import ExpertLayout, LayoutKind, expand, expand_torch, per_pair_layout
from .expert_gemm import expert_gemm
from .finalize import finalize, finalize_torch
from .fused_moe import fused_experts
from .integrations.transformers import from_transformers, register_experts_implementation
from .backends import ExpertBackend, ModelContext, Resolution, pad_experts, resolve
from .layer import FusedMoE, SharedCombination
from .platform import Platform, detect_platform
from .reference import fused_experts_torch
from .routing import (RoutingSpec, Scoring, SelectOn, biased_sigmoid_topk, grouped_topk, route, route_torch,
                      softmax_topk, topk_sigmoid, topk_softmax)

register_experts_implementation()

__all__ = [
    "SILU_AND_MUL", "Activation", "ActivationKind", "activate", "activation_torch",
    "GemmConfig", "MoEConfig", "choose_config",
    "ExpertLayout", "LayoutKind", "expand", "expand_torch", "per_pair_layout", "expert_gemm", "finalize", "finalize_torch",
    "fused_experts", "fused_experts_torch", "from_transformers",
    "ExpertBackend", "FusedMoE", "SharedCombination", "ModelContext", "Resolution", "resolve", "pad_experts",
    "Platform", "detect_platform",
    "RoutingSpec", "Scoring", "SelectOn", "route", "route_torch",
    "softmax_topk", "topk_softmax", "topk_sigmoid", "biased_sigmoid_topk", "grouped_topk",
]
