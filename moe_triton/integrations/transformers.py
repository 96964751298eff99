"""transformers' `"moe_triton"` experts implementation, in `ExpertsInterface` and (FP8Experts,
which transformers builds only on FP8-capable GPUs, else dequantizes) `FP8ExpertsInterface`."""
from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch
from torch import nn

from ..activation import Activation, ActivationKind
from ..pipeline import run_experts
from ..weights import ExpertWeights, Fp8Scaling, WeightFormat, _gate_rows_first

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
    limit, alpha = getattr(experts, "swiglu_limit", None), getattr(experts, "swiglu_alpha", None)
    if limit is not None and alpha is not None:  # MiniMax-M3 (FP8Experts holds None otherwise)
        return Activation(ActivationKind.CLAMPED_SWIGLU, float(limit), float(alpha))
    limit, alpha = getattr(experts, "limit", None), getattr(experts, "alpha", None)
    if limit is not None and alpha is not None:  # gpt-oss: GptOssExperts._apply_gate
        return Activation(ActivationKind.CLAMPED_SWIGLU, float(limit), float(alpha))
    if (getattr(experts, "gate_softcap", None) is not None
            or getattr(experts, "limit", None) is not None):
        raise ValueError(f"{type(experts).__name__} soft-caps or clamps its gate, which "
                         "moe_triton does not implement")
    act_name = type(getattr(experts, "act_fn", None)).__name__
    if act_name not in _ACTIVATION_BY_CLASS:
        raise ValueError(f"{type(experts).__name__}.act_fn is {act_name}, which moe_triton does "
                         f"not implement; supported: {sorted(_ACTIVATION_BY_CLASS)}")
    kind = _ACTIVATION_BY_CLASS[act_name]
    if (kind is ActivationKind.RELU2) == getattr(experts, "has_gate", True):
        raise ValueError(f"{type(experts).__name__}: activation {act_name} does not match has_gate="
                         f"{getattr(experts, 'has_gate', True)}")
    return Activation(kind)


def experts_tensors(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) as (E, N, C); transposed storage becomes a strided view, never a copy.
    Interleaved gate/up rows (gpt-oss, is_concatenated=False) are copied once into [gate; up]
    order, contiguous: a differentiable copy of gate_up_proj beside the module's own (the
    checkpoint loader reorders at load instead, models/)."""
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{type(experts).__name__} has a post-expert norm, which moe_triton "
                         "does not implement; use experts_implementation='grouped_mm'")
    w13 = experts.gate_up_proj if getattr(experts, "has_gate", True) else experts.up_proj
    w2 = experts.down_proj
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if not getattr(experts, "is_concatenated", True):
        w13 = _gate_rows_first(w13).contiguous()
    return w13, w2


def experts_biases(experts: nn.Module) -> dict[str, torch.Tensor | None]:
    """ExpertWeights' w13_bias / w2_bias from a module with has_bias (none otherwise)."""
    if not getattr(experts, "has_bias", False):
        return dict(w13_bias=None, w2_bias=None)
    prefix = "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"
    w13_bias = getattr(experts, f"{prefix}_bias")
    if not getattr(experts, "is_concatenated", True):
        w13_bias = _gate_rows_first(w13_bias)
    return dict(w13_bias=w13_bias, w2_bias=experts.down_proj_bias)


def moe_triton_experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """ExpertsInterface entry: (T, H), (T, K), (T, K) -> (T, H), on our Triton pipeline."""
    activation, weights = _built(experts, _native_experts)
    dtype = weights.dtype
    x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)  # .to: ~3 µs
    return run_experts(x, weights, top_k_index, top_k_weights, activation=activation)


def moe_triton_fp8_experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """FP8ExpertsInterface entry: FP8Experts on our FP8 kernels; (T, H) bf16/fp16 in and out."""
    activation, weights = _built(experts, _fp8_experts)
    return run_experts(hidden_states, weights, top_k_index, top_k_weights, activation=activation)


class _Built(NamedTuple):
    params: tuple  # the module's parameters when built: held, so no new tensor can take their ids
    state: tuple  # grad mode, then each parameter's (data_ptr, version)
    activation: Activation
    weights: ExpertWeights


_BUILT: weakref.WeakKeyDictionary[nn.Module, _Built] = weakref.WeakKeyDictionary()


def _built(experts: nn.Module, build) -> tuple[Activation, ExpertWeights]:
    """`build(experts)` once per module, again when a parameter is replaced, moved or written,
    or grad mode flips (views and converted scales carry the mode they were built in)."""
    if torch.compiler.is_compiling():  # traced once per graph: nothing to keep
        return build(experts)
    params = tuple(experts._parameters.values())
    grad = torch.is_grad_enabled()
    try:
        state = (grad, *[(p.data_ptr(), p._version) for p in params if p is not None])
    except RuntimeError:  # inference tensors keep no version
        state = (grad, *[p.data_ptr() for p in params if p is not None])
    entry = _BUILT.get(experts)
    if entry is None or entry.state != state or not all(map(operator.is_, entry.params, params)):
        entry = _BUILT[experts] = _Built(params, state, *build(experts))
    return entry.activation, entry.weights


def _native_experts(experts: nn.Module) -> tuple[Activation, ExpertWeights]:
    activation = experts_activation(experts)
    return activation, ExpertWeights(*experts_tensors(experts), gated=activation.gated,
                                     **experts_biases(experts))


def _fp8_experts(experts: nn.Module) -> tuple[Activation, ExpertWeights]:
    activation = experts_activation(experts)
    return activation, fp8_expert_weights(experts, activation.gated)


def fp8_expert_weights(experts: nn.Module, gated: bool = True) -> ExpertWeights:
    """FP8Experts' parameters as ExpertWeights: block scales (one [gate; up] grid) or per-tensor."""
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{type(experts).__name__} has expert biases, which moe_triton does not "
                         "implement")
    prefix = "gate_up_proj" if gated else "up_proj"
    w13, s13 = getattr(experts, prefix), getattr(experts, f"{prefix}_scale_inv")
    w2, s2 = experts.down_proj, experts.down_proj_scale_inv
    static = getattr(experts, "activation_scheme", "dynamic") == "static"
    block = getattr(experts, "block_size", None)
    input_scale = getattr(experts, "gate_up_proj_activation_scale", None)
    try:
        scaling = Fp8Scaling.BLOCK if block else Fp8Scaling.TENSOR
        fmt = WeightFormat(scaling, tuple(block) if block else None, static)
        return ExpertWeights.from_checkpoint(w13, w2, fmt, s13, s2, input_scale, gated)
    except ValueError as error:
        if block is None:
            raise ValueError(f"{type(experts).__name__}: {error}") from None
        raise ValueError(f"{type(experts).__name__}: block scales {tuple(block)} with "
                         f"activation_scheme {experts.activation_scheme!r} and I={w2.shape[2]}: "
                         "moe_triton runs block scales with dynamic activations and a [gate; up] "
                         f"grid it can split ({error})") from None


def register_experts_implementation(name: str = "moe_triton") -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, moe_triton_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        return
    FP8ExpertsInterface.register(name, moe_triton_fp8_experts_forward)
