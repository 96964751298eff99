"""transformers integration: the `"moe_triton"` experts implementation and `from_transformers`.

Importing `moe_triton` registers `"moe_triton"` in transformers' `ExpertsInterface`, and in its
`FP8ExpertsInterface` (integrations/finegrained_fp8.py) for FP8 checkpoints, so

    import moe_triton
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton")

runs our kernels inside an unmodified transformers model (the experts' weights are used in place):
its experts as they are, or its `FP8Experts` (gate_up_proj / down_proj in e4m3 beside
gate_up_proj_scale_inv / down_proj_scale_inv, `block_size`, `activation_scheme`) on our FP8 kernels.
transformers builds FP8Experts only on an FP8-capable GPU; elsewhere it dequantizes on load and the
plain implementation runs.

`from_transformers(block)` builds a `FusedMoE` sharing a transformers sparse-MoE block's tensors;
each supported block has one small adapter below, registered by its class name.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import platform as platforms
from ..activation import Activation, ActivationKind
from ..context import ModelContext
from ..layer import FusedMoE, SharedCombination
from ..pipeline import run_experts
from ..placement import Placement
from ..routing import RoutingSpec, Scoring, SelectOn
from ..weights import ExpertWeights, WeightFormat, per_tensor_rows

# transformers activation classes (ACT2FN values) -> our activation kinds
_ACTIVATION_BY_CLASS = {
    "SiLUActivation": ActivationKind.SILU_AND_MUL,
    "SiLU": ActivationKind.SILU_AND_MUL,
    "GELUActivation": ActivationKind.GELU_AND_MUL,
    "GELUTanh": ActivationKind.GELU_TANH_AND_MUL,
    "PytorchGELUTanh": ActivationKind.GELU_TANH_AND_MUL,
    "NewGELUActivation": ActivationKind.GELU_TANH_AND_MUL,
    "ReLUSquaredActivation": ActivationKind.RELU2,
}


def experts_activation(experts: nn.Module) -> Activation:
    """The `Activation` a transformers experts module applies between its two projections."""
    limit, alpha = getattr(experts, "swiglu_limit", None), getattr(experts, "swiglu_alpha", None)
    if limit is not None and alpha is not None:  # MiniMax-M3's clamped swiglu (FP8Experts holds None otherwise)
        return Activation(ActivationKind.CLAMPED_SWIGLU, float(limit), float(alpha))
    if getattr(experts, "gate_softcap", None) is not None or getattr(experts, "limit", None) is not None:
        raise ValueError(f"{type(experts).__name__} soft-caps or clamps its gate, which moe_triton does not implement")
    act_name = type(getattr(experts, "act_fn", None)).__name__
    if act_name not in _ACTIVATION_BY_CLASS:
        raise ValueError(f"{type(experts).__name__}.act_fn is {act_name}, which moe_triton does not implement; "
                         f"supported: {sorted(_ACTIVATION_BY_CLASS)}")
    kind = _ACTIVATION_BY_CLASS[act_name]
    if (kind is ActivationKind.RELU2) == getattr(experts, "has_gate", True):
        raise ValueError(f"{type(experts).__name__}: activation {act_name} does not match has_gate="
                         f"{getattr(experts, 'has_gate', True)}")
    return Activation(kind)


def _expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) in (E, N, K_in) form; transposed storage becomes a strided view, never a copy."""
    if getattr(experts, "has_bias", False) or getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{type(experts).__name__} has expert biases or a post-expert norm, "
                         "which moe_triton does not implement; use experts_implementation='grouped_mm'")
    if not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{type(experts).__name__} interleaves gate and up rows; moe_triton needs [gate; up]")
    w13 = experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj
    w2 = experts.down_proj
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def moe_triton_experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """ExpertsInterface entry: (T, H), (T, K), (T, K) -> (T, H), on our Triton pipeline."""
    activation = experts_activation(experts)
    weights = ExpertWeights(*_expert_weights(experts), gated=activation.gated)
    x = hidden_states.to(weights.dtype)
    return run_experts(x, weights, top_k_index, top_k_weights, activation=activation)


def moe_triton_fp8_experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """FP8ExpertsInterface entry: transformers' FP8Experts on our FP8 kernels; (T, H) bf16/fp16 in and out."""
    activation = experts_activation(experts)
    weights = fp8_expert_weights(experts, activation.gated)
    return run_experts(hidden_states, weights, top_k_index, top_k_weights, activation=activation)


def fp8_expert_weights(experts: nn.Module, gated: bool = True) -> ExpertWeights:
    """FP8Experts' parameters as they are, as ExpertWeights: block scales (one grid over [gate; up], split
    only where I is a multiple of block_n), or per-tensor ones ([E, 2, 1] gate and up, or [E, 1, 1]),
    with the static input scale, the largest of `gate_up_proj_activation_scale`."""
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{type(experts).__name__} has expert biases, which moe_triton does not implement")
    prefix = "gate_up_proj" if gated else "up_proj"
    w13, s13 = getattr(experts, prefix), getattr(experts, f"{prefix}_scale_inv")
    w2, s2 = experts.down_proj, experts.down_proj_scale_inv
    E, rows, H = w13.shape
    static = getattr(experts, "activation_scheme", "dynamic") == "static"
    block = getattr(experts, "block_size", None)
    if block is not None:
        if static or (gated and (rows // 2) % block[0]):
            raise ValueError(f"{type(experts).__name__}: block scales {tuple(block)} with activation_scheme "
                             f"{experts.activation_scheme!r} and I={w2.shape[2]}: moe_triton runs block scales with "
                             "dynamic activations and a [gate; up] grid it can split (I % block_n == 0)")
        fmt, s13, s2 = WeightFormat.fp8_block(*block), s13.float(), s2.float()
    else:  # per tensor
        fmt = WeightFormat.fp8_tensor(static_input=static)
        s13 = per_tensor_rows(s13.float().reshape(E, -1) if s13[0].numel() == 2 else s13.float().reshape(E), rows)
        s2 = per_tensor_rows(s2.float().reshape(E), H)
    input_scale = experts.gate_up_proj_activation_scale.float().max().reshape(1) if static else None
    return ExpertWeights(w13, w2, gated, fmt, s13, s2, input_scale)


def register_experts_implementation(name: str = "moe_triton") -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, moe_triton_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        return
    FP8ExpertsInterface.register(name, moe_triton_fp8_experts_forward)


# ---- from_transformers: one adapter per sparse-MoE block class -------------------------------

_ADAPTERS: dict[str, Callable[[nn.Module], dict]] = {}


def _adapter(*class_names: str):
    def register(fn):
        for name in class_names:
            _ADAPTERS[name] = fn
        return fn
    return register


@_adapter("Qwen3MoeSparseMoeBlock")
def _qwen3_moe(block) -> dict:
    gate = block.gate
    return dict(routing=RoutingSpec(gate.top_k, renormalize=bool(gate.norm_topk_prob)))


@_adapter("Cohere2MoeSparseMoeBlock")
def _cohere2_moe(block) -> dict:
    gate = block.gate
    scoring = Scoring.SOFTMAX if gate.expert_selection_fn == "softmax" else Scoring.SIGMOID
    routing = RoutingSpec(gate.top_k, scoring, SelectOn.LOGITS,
                          renormalize=scoring is Scoring.SIGMOID and bool(gate.norm_topk_prob))
    shared = block.shared_experts if block.num_shared_experts > 0 else None
    return dict(routing=routing, shared_experts=shared,
                shared_combination=SharedCombination(block.shared_expert_combination_strategy))


@_adapter("MiniMaxM2SparseMoeBlock")
def _minimax_m2(block) -> dict:
    return dict(routing=RoutingSpec(block.gate.top_k, Scoring.SIGMOID, renormalize=True, correction_bias=True),
                correction_bias=block.e_score_correction_bias)


@_adapter("MiniMaxM3VLSparseMoeBlock")
def _minimax_m3(block) -> dict:
    # transformers scales the routed output; the same factor on the routing weights is the same sum
    routing = RoutingSpec(block.gate.top_k, Scoring.SIGMOID, renormalize=True, correction_bias=True,
                          routed_scaling_factor=float(block.routed_scaling_factor))
    return dict(routing=routing, correction_bias=block.gate.e_score_correction_bias, shared_experts=block.shared_experts)


@_adapter("NemotronHMoE")
def _nemotron_h(block) -> dict:
    gate = block.gate
    routing = RoutingSpec(gate.top_k, Scoring.SIGMOID, renormalize=bool(gate.norm_topk_prob),
                          n_group=gate.num_group, topk_group=gate.topk_group,
                          routed_scaling_factor=float(gate.routed_scaling_factor), correction_bias=True,
                          router_in_float32=True)
    return dict(routing=routing, correction_bias=gate.e_score_correction_bias, shared_experts=block.shared_experts,
                expert_input_proj=block.fc1_latent_proj, expert_output_proj=block.fc2_latent_proj)


def from_transformers(block: nn.Module, backend: str = "auto", context: ModelContext | None = None) -> FusedMoE:
    """A `FusedMoE` computing what `block` computes, sharing its parameters (no copies unless the
    resolved backend pads or prepares them). `context` tells backend choice the model's
    architecture, quantization config, all-to-all and LoRA (see runners/resolver.py)."""
    name = type(block).__name__
    if name not in _ADAPTERS:
        raise ValueError(f"from_transformers does not know {name}; supported blocks: {sorted(_ADAPTERS)}")
    parts = _ADAPTERS[name](block)
    bias = parts.pop("correction_bias", None)
    w13, w2 = _expert_weights(block.experts)
    E, I, H = w2.shape[0], w2.shape[2], block.gate.weight.shape[1]
    # Built on the meta device (nothing allocated), resolved for the block's own device, then given its tensors.
    placement = Placement(backend, context or ModelContext(), platform=platforms.detect_platform(w13.device))
    layer = FusedMoE(E, parts["routing"].top_k, H, I, activation=experts_activation(block.experts),
                     placement=placement, dtype=w13.dtype, device="meta", **parts)
    layer.gate_weight = block.gate.weight
    layer.gate_up_proj = w13 if isinstance(w13, nn.Parameter) else nn.Parameter(w13, w13.requires_grad)
    layer.down_proj = w2 if isinstance(w2, nn.Parameter) else nn.Parameter(w2, w2.requires_grad)
    if bias is not None:
        layer.e_score_correction_bias = bias
    layer.prepare_weights()
    return layer
