"""The expert pipeline: `run_experts` on `ExpertWeights`, `fused_experts` on plain tensors; every
argument is checked once per call signature, whose `LayerPlan.__call__` is the diagram."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import checks
from .activation import SILU_AND_MUL, Activation, ActivationKind
from .config import FP8_MIN_STEP, INVARIANT_TOKENS, MoEConfig, choose_config
from .decode import DecodePlan, plan_decode_layer
from .expand import ExpandPlan, LayoutKind, UnsortedPlan, layout_like, plan_expand
from .expert_gemm import ExpertGemmPlan, Fp8Scales, Mxfp4Scales, plan_expert_gemm
from .finalize import FinalizePlan, plan_finalize
from .invariance import batch_invariant_enabled
from .launch import PlanCache, register_op
from .platform import (
    INTERPRETER_DOT_DTYPES,
    dependent_launch,
    interpreter_dot_reason,
    interpreter_hint,
    triton_can_run_on,
)
from .quantize import QuantizePlan, plan_quantize
from .reference import fused_experts_backward_torch
from .weights import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    NATIVE,
    ExpertWeights,
    Fp8Scaling,
    WeightFormat,
    tensor_signature,
)


def check_experts_args(hidden_states, weights: ExpertWeights, topk_ids,
                       topk_weights) -> tuple[int, int]:
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be a 2-D tensor (T, H), "
                         f"got {_describe(hidden_states)}; "
                         "flatten leading dimensions with hidden_states.reshape(-1, H)")
    if hidden_states.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden_states dtype {hidden_states.dtype} is not supported; "
                         f"use one of {FLOAT_DTYPES}")
    T, H = hidden_states.shape
    device, dtype = hidden_states.device, hidden_states.dtype
    if weights.format.fp8 is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"hidden_states is {dtype}; FP8 experts take bfloat16 or float16 "
                         "activations (their output dtype): cast hidden_states")
    if (not weights.format.quantized and weights.dtype != dtype) or weights.device != device:
        raise ValueError(f"the expert weights are {weights.dtype} on {weights.device} but "
                         f"hidden_states is {dtype} on {device}; "
                         "cast/move the weights (w13, w2) to match")
    if weights.hidden_size != H:
        raise ValueError(f"w13 has input size {weights.hidden_size} but hidden_states has H={H}")
    if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2
            or topk_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"topk_ids must be a 2-D int32/int64 tensor (T, K), "
                         f"got {_describe(topk_ids)}")
    K = topk_ids.shape[1]
    if topk_ids.shape[0] != T or topk_ids.device != device:
        raise ValueError(f"topk_ids must have {T} rows on {device}, "
                         f"got {tuple(topk_ids.shape)} on {topk_ids.device}")
    if K < 1:  # K > E is legal: expert-parallel shards filter the ids of other ranks' experts
        raise ValueError(f"top_k (topk_ids.shape[1]) must be >= 1, got {K}")
    if (not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != topk_ids.shape
            or not topk_weights.dtype.is_floating_point):
        raise ValueError(f"topk_weights must be a floating tensor of shape "
                         f"{tuple(topk_ids.shape)}, got {_describe(topk_weights)}")
    if topk_weights.device != device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, hidden_states on {device}")
    if not triton_can_run_on(device):
        raise ValueError(f"Triton kernels cannot run on {device}: move the tensors to a CUDA "
                         f"device, {interpreter_hint()}, or use the torch backend")
    if device.type == "cpu" and dtype not in INTERPRETER_DOT_DTYPES:
        reason = interpreter_dot_reason(dtype, fp8_experts=weights.format.fp8 is not None)
        raise ValueError(f"hidden_states and the expert weights are {dtype} on CPU, but {reason} "
                         "(moe_triton.fused_experts_torch, backend='torch')")
    return T, K


def check_specs(activation, config) -> None:
    if (not isinstance(activation, Activation)
            or not (config is None or isinstance(config, MoEConfig))):
        raise ValueError(f"activation must be an Activation and config a MoEConfig or None, got "
                         f"{type(activation).__name__} and {type(config).__name__}")


def check_out(out, T: int, H: int, hidden_states: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a tensor of shape ({T}, {H}) or None, "
                         f"got {type(out).__name__}")
    if tuple(out.shape) != (T, H):
        raise ValueError(f"out must have shape (T, H) = ({T}, {H}), got {tuple(out.shape)}")
    if out.dtype != hidden_states.dtype:
        raise ValueError(f"out must have dtype {hidden_states.dtype} (hidden_states' dtype), "
                         f"got {out.dtype}")
    if out.device != hidden_states.device:
        raise ValueError(f"out must be on device {hidden_states.device} (hidden_states'), "
                         f"got {out.device}")
    if T > 0 and out.stride(1) != 1:
        raise ValueError(f"out must have unit last stride (rows of H contiguous elements), "
                         f"got strides {out.stride()}")


def run_experts(
    hidden_states: torch.Tensor,
    weights: ExpertWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: Activation = SILU_AND_MUL,
    config: MoEConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden_states (T, H) -> a fresh (T, H). An id outside [0, E) is filtered (no contribution;
    E and -1 both work), so K may exceed E. Compiled, exported or with gradients needed: the
    registered op `torch.ops.moe_triton.experts` (its backward: reference.py)."""
    if torch.compiler.is_compiling():
        _refuse_eager_tools(config, out)
        return torch.ops.moe_triton.experts(hidden_states, *_weights_fields(weights), topk_ids,
                                            topk_weights, *_activation_fields(activation))
    if checks.grad_needed(hidden_states, topk_weights,
                          *(getattr(weights, name, None)
                            for name in ("w13", "w2", "w13_bias", "w2_bias"))):
        return _experts_with_grad(hidden_states, weights, topk_ids, topk_weights, activation,
                                  config, out)
    plan = _plan(hidden_states, weights, topk_ids, topk_weights, activation, config, out)
    return plan(hidden_states, weights, topk_ids, topk_weights, out)


def _plan(hidden_states, weights, topk_ids, topk_weights, activation, config, out) -> LayerPlan:
    signature = _call_signature(hidden_states, weights, topk_ids, topk_weights, activation, config,
                                out)
    plan = _PLANS.get(signature)
    if plan is None:
        plan = _PLANS.add(signature, plan_experts(hidden_states, weights, topk_ids, topk_weights,
                                                  activation=activation, config=config,
                                                  out=out))
    return plan


def _experts_with_grad(hidden_states, weights, topk_ids, topk_weights, activation, config, out):
    if config is not None or out is not None:
        raise ValueError("config= and out= have no backward; with gradients needed (grad "
                         "mode on, an input or weight requiring grad) call the experts without "
                         "them, or under torch.no_grad()")
    checks.not_capturing("run_experts")
    _plan(hidden_states, weights, topk_ids, topk_weights, activation, None, None)
    return torch.ops.moe_triton.experts(hidden_states, *_weights_fields(weights), topk_ids,
                                        topk_weights, *_activation_fields(activation))


def plan_experts(hidden_states, weights: ExpertWeights, topk_ids, topk_weights, *,
                 activation: Activation, config: MoEConfig | None, out) -> LayerPlan:
    check_specs(activation, config)
    if weights.gated != activation.gated:
        raise ValueError(f"the weights are {'gated' if weights.gated else 'non-gated'} but "
                         f"activation {activation.kind.name} is "
                         f"{'gated' if activation.gated else 'not'}")
    T, K = check_experts_args(hidden_states, weights, topk_ids, topk_weights)
    H = weights.hidden_size
    check_out(out, T, H, hidden_states)
    config = config or default_config(T, K, weights, hidden_states.device)
    if weights.format.fp8 is not None:
        _check_fp8_config(config, hidden_states.device)
    return LayerPlan.build(hidden_states, weights, topk_ids, topk_weights, activation, config, out)


def default_config(num_tokens: int, top_k: int, weights: ExpertWeights,
                   device: torch.device) -> MoEConfig:
    """choose_config's tiles for a call on `weights` (FP8: steps within their block); in
    batch-invariant mode the tiles of INVARIANT_TOKENS whatever the call's T (invariance.py)."""
    block = weights.format.block
    if batch_invariant_enabled():
        num_tokens = INVARIANT_TOKENS
    return choose_config(max(num_tokens, 1), top_k, weights.num_experts, weights.hidden_size,
                         weights.intermediate_size, device, weights.dtype,
                         fp8_group=block[1] if block is not None else 128)


@dataclass(frozen=True)
class LayerPlan:
    """run_experts for one call signature: every stage's plan, built before anything launches."""

    num_tokens: int  # T; 0 launches nothing
    hidden_size: int  # H
    expand: ExpandPlan | UnsortedPlan  # topk_ids -> ExpertLayout (unsorted: no launch)
    quantize: QuantizePlan | None  # FP8 only: hidden_states -> e4m3 [T, H] + scales
    up: ExpertGemmPlan | None  # gather + w13 + activation epilogue -> [R, I] (FP8: e4m3 + scales)
    down: ExpertGemmPlan | None  # w2 -> [R, H], or [S, R, H] float32 split-C partials
    decode: DecodePlan | None  # instead of quantize, up, down and finalize: one launch
    finalize: FinalizePlan | None  # weighted un-permute -> a fresh [T, H] (or `out`)

    @property
    def holds_scratch(self) -> bool:  # PlanCache keeps it: a graph may write the decode scratch
        return self.decode is not None and self.decode.holds_scratch

    def __call__(self, hidden_states, weights: ExpertWeights, topk_ids, topk_weights,
                 out=None) -> torch.Tensor:
        if self.num_tokens == 0:
            H, dtype, device = self.hidden_size, hidden_states.dtype, hidden_states.device
            return torch.empty(0, H, dtype=dtype, device=device) if out is None else out
        layout = self.expand(topk_ids)
        if self.decode is not None:
            return self.decode(hidden_states, weights, layout, topk_weights, out)  # [T, H]
        x, x_scales = hidden_states, None
        if self.quantize is not None:
            x, x_scales = self.quantize(hidden_states, weights.input_scale)  # [T, H] e4m3, [T, G]
        # [R, I], [R, I / BLOCK_N]
        h, h_scales = self.up(x, weights.w13, layout, x_scales, weights.w13_scale,
                              bias=weights.w13_bias)
        y, _ = self.down(h, weights.w2, layout, h_scales, weights.w2_scale,
                         bias=weights.w2_bias)  # [R, H] or [S, R, H]
        return self.finalize(y, topk_weights, layout, out)  # [T, H]

    @classmethod
    def build(cls, hidden_states, weights: ExpertWeights, topk_ids, topk_weights,
              activation: Activation, config: MoEConfig, out) -> LayerPlan:
        """The plan for checked arguments; each stage plans from meta stand-ins of its inputs."""
        T, K = topk_ids.shape
        E, H, dtype, block_m = (weights.num_experts, weights.hidden_size, hidden_states.dtype,
                                config.block_m)
        layout = layout_like(config.layout, T, K, E, block_m)
        sorted_layout = config.layout is LayoutKind.SORTED
        expand = (plan_expand(T, K, E, block_m, hidden_states.device) if sorted_layout
                  else UnsortedPlan(config.layout, E, block_m))
        if config.decode is not None:
            decode = plan_decode_layer(hidden_states, weights, layout, topk_weights,
                                       config.decode, activation, out)
            return cls(T, H, expand, None, None, None, decode, None)
        fp8 = weights.format.fp8 is not None
        x, quantize, up_scales, down_scales = hidden_states, None, None, None
        if fp8:
            quantize, x, up_scales = _plan_quantize(hidden_states, weights)
        if weights.format.fp4:  # W4A16: activations as they are, the weights' E8M0 bytes
            up_scales = Mxfp4Scales(weights.w13_scale, weights.w13_scale_up_offset)
            down_scales = Mxfp4Scales(weights.w2_scale)
        # decode: up, down and finalize launch as PDL dependents (config.down.chained), up
        # behind the routing (or quantize) kernel
        pdl = config.down.chained and dependent_launch(hidden_states.device)
        up = plan_expert_gemm(x, weights.w13, layout, config.up, gather=True, activation=activation,
                              scales=up_scales, out_dtype=FP8_DTYPE if fp8 else dtype,
                              chained=pdl, bias=weights.w13_bias)
        h, h_scales = up.outputs("meta")
        if fp8:  # the intermediate: one scale per row and up.block_n columns
            down_scales = Fp8Scales(h_scales, config.up.block_n, weights.w2_scale,
                                    weights.format.block)
        down = plan_expert_gemm(h, weights.w2, layout, config.down, gather=False,
                                scales=down_scales, out_dtype=dtype, chained=pdl,
                                bias=weights.w2_bias)
        y, _ = down.outputs("meta")
        finalize = plan_finalize(y, topk_weights, layout, dtype, out, chained=pdl)
        return cls(T, H, expand, quantize, up, down, None, finalize)


def _plan_quantize(hidden_states,
                   weights: ExpertWeights) -> tuple[QuantizePlan, torch.Tensor, Fp8Scales]:
    """(quantize, x as up reads it, up's scales)."""
    block = weights.format.block
    group = block[1] if block is not None else None
    quantize = plan_quantize(hidden_states, group, weights.input_scale is not None)
    x, x_scales = quantize.outputs("meta", weights.input_scale)  # [T, H] e4m3, [T, G]
    scales = Fp8Scales(x_scales, group or weights.hidden_size, weights.w13_scale, block,
                       weights.w13_scale_up_offset)
    return quantize, x, scales


def _call_signature(hidden_states, weights, topk_ids, topk_weights, activation, config, out):
    """What the checks and launches depend on (the batch-invariant mode too: it picks the tiles);
    None for a wrong-kind argument (checks name it)."""
    try:
        signature = (tensor_signature(hidden_states), weights.signature,
                     tensor_signature(topk_ids), tensor_signature(topk_weights), activation,
                     config, None if out is None else tensor_signature(out),
                     batch_invariant_enabled())
        hash(signature)
    except (AttributeError, TypeError):
        return None
    return signature


_PLANS = PlanCache()


# ---- the op torch.compile and torch.export see: one opaque node, a fake for its shapes ----------

_FP8 = [None, *Fp8Scaling]


def _weights_fields(weights: ExpertWeights) -> tuple:
    return (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale, weights.input_scale,
            weights.w13_bias, weights.w2_bias, weights.gated, *_format_fields(weights.format))


def _format_fields(fmt: WeightFormat) -> tuple:
    block_n, block_c = fmt.block or (0, 0)
    return _FP8.index(fmt.fp8), block_n, block_c, fmt.static_input, fmt.fp4


def _format(fp8: int, block_n: int, block_c: int, static_input: bool, fp4: bool) -> WeightFormat:
    return WeightFormat(_FP8[fp8], (block_n, block_c) if block_n else None, static_input, fp4)


def _refuse_eager_tools(config, out) -> None:
    if config is not None or out is not None:
        raise ValueError("config= and out= are eager tools; under torch.compile or torch.export "
                         "call the experts without them (the output is fresh)")


def _activation_fields(activation: Activation) -> tuple:
    return activation.kind.value, float(activation.swiglu_limit), float(activation.swiglu_alpha)


def _experts_fake(hidden_states, *args):
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


# the op's inputs that take a gradient, by position: x, w13, w2, w13_bias, w2_bias, topk_weights
_GRAD_INPUTS = (0, 1, 2, 6, 7, 15)


def _experts_setup_context(ctx, inputs, output):
    (hidden_states, w13, w2, w13_scale, w2_scale, _, w13_bias, w2_bias, gated, fp8, block_n,
     block_c, _, fp4, ids, weights, *act) = inputs
    ctx.save_for_backward(hidden_states, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, ids,
                          weights)
    ctx.fields = (gated, fp8, block_n, block_c, fp4, *act)


def _experts_backward(ctx, grad_out):
    hidden_states, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, ids, weights = ctx.saved_tensors
    needed = [ctx.needs_input_grad[i] for i in _GRAD_INPUTS]
    quantized = ctx.fields[1] != 0 or ctx.fields[4]  # e4m3 / e2m1 weights get no gradient
    wanted = [need and not (quantized and i in (1, 2)) for i, need in zip(_GRAD_INPUTS, needed,
                                                                          strict=True)]
    grads = torch.ops.moe_triton.experts_backward(grad_out, hidden_states, w13, w2, w13_scale,
                                                  w2_scale, w13_bias, w2_bias, ids, weights,
                                                  *ctx.fields, wanted)
    by_input = dict(zip(_GRAD_INPUTS, (grad if want else None
                                       for grad, want in zip(grads, wanted, strict=True)),
                        strict=True))
    return tuple(by_input.get(i) for i in range(19))


@register_op("experts", _experts_fake, backward=_experts_backward,
             setup_context=_experts_setup_context)
def _experts_op(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                input_scale: torch.Tensor | None, w13_bias: torch.Tensor | None,
                w2_bias: torch.Tensor | None, gated: bool, fp8: int, block_n: int,
                block_c: int, static_input: bool, fp4: bool, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, activation: int, swiglu_limit: float,
                swiglu_alpha: float) -> torch.Tensor:
    weights = ExpertWeights(w13, w2, gated, _format(fp8, block_n, block_c, static_input, fp4),
                            w13_scale, w2_scale, input_scale, w13_bias, w2_bias)
    act = Activation(ActivationKind(activation), swiglu_limit, swiglu_alpha)
    return run_experts(hidden_states, weights, topk_ids, topk_weights, activation=act)


def _experts_backward_fake(grad_out, hidden_states, w13, w2, w13_scale, w2_scale, w13_bias,
                           w2_bias, topk_ids, topk_weights, *args):
    wanted = args[-1]
    return tuple(t.new_empty(t.shape) if want else grad_out.new_empty(0)
                 for t, want in zip((hidden_states, w13, w2, w13_bias, w2_bias, topk_weights),
                                    wanted, strict=True))


@register_op("experts_backward", _experts_backward_fake)
def _experts_backward_op(grad_out: torch.Tensor, hidden_states: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, w13_scale: torch.Tensor | None,
                         w2_scale: torch.Tensor | None, w13_bias: torch.Tensor | None,
                         w2_bias: torch.Tensor | None, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, gated: bool, fp8: int, block_n: int,
                         block_c: int, fp4: bool, activation: int, swiglu_limit: float,
                         swiglu_alpha: float, wanted: list[bool]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """(d hidden_states, d w13, d w2, d w13_bias, d w2_bias, d topk_weights); an empty tensor
    where not wanted."""
    # the input scale plays no part
    weights = ExpertWeights(w13, w2, gated, _format(fp8, block_n, block_c, False, fp4),
                            w13_scale, w2_scale, w13_bias=w13_bias, w2_bias=w2_bias)
    act = Activation(ActivationKind(activation), swiglu_limit, swiglu_alpha)
    x_w, w13_w, w2_w, b13_w, b2_w, tw_w = wanted
    dx, dw13, dw2, dtw, db13, db2 = fused_experts_backward_torch(
        grad_out, hidden_states, weights, topk_ids, topk_weights, activation=act,
        needs=(x_w, w13_w, w2_w, tw_w, b13_w, b2_w))
    return tuple(grad if grad is not None else grad_out.new_empty(0)
                 for grad in (dx, dw13, dw2, db13, db2, dtw))


def _check_fp8_config(config: MoEConfig, device: torch.device) -> None:
    if device.type == "cuda":  # scale groups narrower than a step are fine (expert_gemm.py)
        for name, gemm in (("up", config.up), ("down", config.down)):
            if gemm.block_c < FP8_MIN_STEP:
                raise ValueError(f"config.{name}.block_c={gemm.block_c}: FP8 GEMMs on a GPU step "
                                 f"at least {FP8_MIN_STEP} columns (8-bit tl.dot: K >= 32 on SM90)")


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: Activation = SILU_AND_MUL,
    config: MoEConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`run_experts` on w13 (E, 2I, H) [gate; up], or (E, I, H) non-gated, and w2 (E, H, I)."""
    if torch.compiler.is_compiling():  # the op takes plain data: no ExpertWeights in the graph
        _refuse_eager_tools(config, out)
        return torch.ops.moe_triton.experts(hidden_states, w13, w2, None, None, None, None, None,
                                            activation.gated, *_format_fields(NATIVE), topk_ids,
                                            topk_weights, *_activation_fields(activation))
    check_specs(activation, config)
    weights = ExpertWeights(w13, w2, gated=activation.gated)
    return run_experts(hidden_states, weights, topk_ids, topk_weights, activation=activation,
                       config=config, out=out)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"
