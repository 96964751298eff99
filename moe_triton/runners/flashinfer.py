"""FlashInfer expert backends (flashinfer-python 0.7.2.post1), imported lazily. Weights are
prepared once, after padding, by FlashInfer's `*Config.prepare_weights` (row shuffle, BlockMajorK;
NVFP4: E4M3 block scales, global scale 1, activations quantized each forward) and kept under its
keyword names. Its GEMM1 rows are [up; gate] (TRT-LLM's "w3_w1"), ours [gate; up]: `up_gate`
swaps them (unswapped, silu(up) * gate is plausible but wrong). A checkpoint's own NVFP4 tensors
are not loaded. Verified on hardware: none (trtllm-gen is SM100/SM103 only; the SM90 CUTLASS MoE
compiles for over an hour). Tested on CPU: every argument and the weight preparation, against
checkers with the published signatures.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch

from .. import checks
from ..activation import Activation, ActivationKind
from ..quant_config import QuantFormat
from ..routing import RoutingSpec, Scoring, SelectOn
from ..weights import ExpertWeights
from .runner import ExpertsRunner, refuse_compile

# tllm_enums.ActivationType names, and fused_moe's typed activation values
_ACTIVATION_TYPE = {ActivationKind.SILU_AND_MUL: "Swiglu", ActivationKind.RELU2: "Relu2"}
_ACTIVATION_CONFIG = {ActivationKind.SILU_AND_MUL: "SwiGLU", ActivationKind.RELU2: "ReLU2"}
_PRECOMPUTED_ROUTING = "TopK"  # routed calls: ids and weights are final, no softmax or renorm


@dataclass(frozen=True)
class FlashInferModules:
    fused_moe: ModuleType  # flashinfer.fused_moe: kernels, *Config.prepare_*, SwiGLU() / ReLU2()
    enums: ModuleType  # flashinfer.tllm_enums: RoutingMethodType, ActivationType, WeightLayout, ...


def import_flashinfer() -> FlashInferModules:
    try:
        return FlashInferModules(importlib.import_module("flashinfer.fused_moe"),
                                 importlib.import_module("flashinfer.tllm_enums"))
    except ImportError as error:
        raise ImportError("FlashInfer backends need FlashInfer: "
                          f"pip install 'moe-triton[flashinfer]' ({error})") from error


def fused_routing_method(routing: RoutingSpec) -> str | None:
    """The trtllm-gen RoutingMethodType that computes exactly what `route` computes, or None."""
    if routing.correction_bias or routing.n_group > 1 or routing.routed_scaling_factor != 1.0:
        return None  # biased / grouped / scaled selection: flashinfer_trtllm_routed on our top-k
    if routing.scoring is Scoring.SOFTMAX:
        # top-k on logits, softmax over the k == softmax, top-k, renormalise: one FlashInfer method
        return ("Renormalize" if routing.select_on is SelectOn.LOGITS or routing.renormalize
                else "Default")
    # sigmoid is monotone: select on either
    return "SigmoidRenorm" if routing.renormalize else "Sigmoid"


@dataclass(frozen=True)
class FlashInferExperts:
    quant: QuantFormat  # NONE (bf16) or NVFP4
    activation: ActivationKind
    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I, already padded to the backend's multiple
    weights: Mapping[str, torch.Tensor]  # FlashInfer's prepared view, keyed by its keyword names


def up_gate(w13: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Our [gate; up] (E, 2I, H) as FlashInfer's [up; gate]; non-gated (E, I, H) unchanged."""
    if not activation.gated:
        return w13.contiguous()
    gate, up = w13.chunk(2, dim=1)  # [E, I, H] each
    return torch.cat([up, gate], dim=1)  # [E, 2I, H]


def prepare_experts(config_name: str, w13: torch.Tensor, w2: torch.Tensor, activation: Activation,
                    quant: QuantFormat, fi: FlashInferModules) -> FlashInferExperts:
    """w13 (E, 2I, H) [gate; up] or (E, I, H), w2 (E, H, I) -> `<config_name>.prepare_weights`."""
    if activation.kind not in _ACTIVATION_TYPE:
        raise ValueError(f"activation {activation.kind.name} has no FlashInfer equivalent; "
                         f"use {sorted(k.name for k in _ACTIVATION_TYPE)}")
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError("FlashInfer backends take bfloat16 weights, "
                         f"got {w13.dtype} / {w2.dtype}; build the layer with dtype=torch.bfloat16")
    E, H, I = w2.shape
    geometry = dict(num_local_experts=E, hidden_size=H, intermediate_size=I, device=w13.device,
                    activation=getattr(fi.fused_moe, _ACTIVATION_CONFIG[activation.kind])())
    config = getattr(fi.fused_moe, config_name)
    weights = config.prepare_weights(up_gate(w13, activation), w2.contiguous(), **geometry)
    return FlashInferExperts(quant, activation.kind, E, H, I, dict(weights))


class FlashInferRunner(ExpertsRunner):
    """The three paths' share: FlashInfer imported and the weights' view built once, in prepare."""

    prepared: FlashInferExperts | None = None
    fi: FlashInferModules | None = None

    def weights_config(self, quant: QuantFormat) -> str:
        """FlashInfer's *Config class whose prepare_weights builds this path's view."""
        raise NotImplementedError

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        weights = super().prepare(weights)  # padded to the spec's multiple first
        self.fi = import_flashinfer()
        quant = self.context.quantization.experts.format
        self.prepared = prepare_experts(self.weights_config(quant), weights.w13, weights.w2,
                                        self.activation, quant, self.fi)
        return weights

    def check_input(self, hidden_states: torch.Tensor, *tensors: torch.Tensor) -> None:
        """`tensors`: the call's other inputs, which must not need gradients either."""
        if torch.compiler.is_compiling():  # FlashInfer's entry points have not been traced
            refuse_compile(hidden_states, f"the {self.spec.backend} backend")
        if self.prepared is None:
            raise RuntimeError(f"backend {self.spec.backend} runs on prepared weights: "
                               "call layer.prepare_weights() once after loading them")
        checks.no_grad_needed(f"the {self.spec.backend} backend", "use the triton or torch backend",
                              hidden_states, *tensors)
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(f"x is {hidden_states.dtype}; "
                             "FlashInfer backends take bfloat16 hidden states")


class TrtllmRoutedRunner(FlashInferRunner):
    def weights_config(self, quant):
        return "TrtllmFp4Config" if quant is QuantFormat.NVFP4 else "TrtllmBf16Config"

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        self.check_input(hidden_states, topk_weights, weights.w13, weights.w2)
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states)
        return run_trtllm_routed(self.prepared, self.fi, hidden_states, topk_ids, topk_weights)


class TrtllmRunner(TrtllmRoutedRunner):
    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        raise ValueError("flashinfer_trtllm routes inside its kernel from the router logits: "
                         "call the layer, or use flashinfer_trtllm_routed "
                         "to run it on a given top-k")

    def __call__(self, weights, hidden_states, router_logits, correction_bias=None):
        self.check_input(hidden_states, router_logits, weights.w13, weights.w2)
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states)
        return run_trtllm(self.prepared, self.fi, hidden_states, router_logits, self.routing)


class CutlassRunner(FlashInferRunner):
    def weights_config(self, quant):
        return "CutlassBf16Config"

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        self.check_input(hidden_states, topk_weights, weights.w13, weights.w2)
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states)
        return run_cutlass(self.prepared, self.fi, hidden_states, topk_ids, topk_weights)


def _trtllm_common(experts: FlashInferExperts, fi: FlashInferModules, top_k: int,
                   routing_method: str) -> dict:
    return dict(
        num_experts=experts.num_experts, top_k=top_k, n_group=None, topk_group=None,
        intermediate_size=experts.intermediate_size, local_expert_offset=0,
        local_num_experts=experts.num_experts, routed_scaling_factor=None,
        routing_method_type=int(fi.enums.RoutingMethodType[routing_method]),
        activation_type=int(fi.enums.ActivationType[_ACTIVATION_TYPE[experts.activation]]),
        do_finalize=True,
    )


def _trtllm_weights(experts: FlashInferExperts, fi: FlashInferModules,
                    hidden_states: torch.Tensor) -> dict:
    if experts.quant is not QuantFormat.NVFP4:
        return dict(hidden_states=hidden_states, use_shuffled_weight=True,
                    weight_layout=int(fi.enums.WeightLayout.BlockMajorK), **experts.weights)
    # [T, H/2], [T, H/16]
    hidden_fp4, hidden_scale = fi.fused_moe.TrtllmFp4Config.prepare_activations(hidden_states)
    weights = dict(experts.weights)
    return dict(hidden_states=hidden_fp4, hidden_states_scale=hidden_scale,
                hidden_states_scale_layout=fi.enums.SfLayout.layout_linear,
                gemm1_bias=None, gemm1_alpha=weights.pop("gemm1_alpha", None), gemm1_beta=None,
                gemm1_clamp_limit=None, gemm2_bias=None, **weights)


def _output(result) -> torch.Tensor:
    # bf16 entry points return the tensor (deprecated) or [output]; the fp4 ones return [output]
    return result[0] if isinstance(result, (list, tuple)) else result


def run_trtllm(experts: FlashInferExperts, fi: FlashInferModules, hidden_states: torch.Tensor,
               router_logits: torch.Tensor, routing: RoutingSpec) -> torch.Tensor:
    """hidden_states (T, H) bf16, router_logits (T, E) -> (T, H); routing inside the kernel."""
    method = fused_routing_method(routing)
    kwargs = dict(routing_logits=router_logits.float(), routing_bias=None,
                  norm_topk_prob=routing.renormalize,
                  **_trtllm_common(experts, fi, routing.top_k, method),
                  **_trtllm_weights(experts, fi, hidden_states))
    kernel = (fi.fused_moe.trtllm_fp4_block_scale_moe if experts.quant is QuantFormat.NVFP4
              else fi.fused_moe.trtllm_bf16_moe)
    return _output(kernel(**kwargs))


def run_trtllm_routed(experts: FlashInferExperts, fi: FlashInferModules,
                      hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (T, H) bf16, our topk_ids / topk_weights (T, K) -> (T, H)."""
    routing = (topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous())  # unpacked
    kwargs = dict(topk_ids=routing,
                  **_trtllm_common(experts, fi, topk_ids.shape[1], _PRECOMPUTED_ROUTING),
                  **_trtllm_weights(experts, fi, hidden_states))
    if experts.quant is QuantFormat.NVFP4:
        return _output(fi.fused_moe.trtllm_fp4_block_scale_routed_moe(routing_bias=None, **kwargs))
    return _output(fi.fused_moe.trtllm_bf16_routed_moe(**kwargs))


def run_cutlass(experts: FlashInferExperts, fi: FlashInferModules, hidden_states: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (T, H) bf16, our topk_ids / topk_weights (T, K) -> (T, H)."""
    activation_type = fi.enums.ActivationType[_ACTIVATION_TYPE[experts.activation]]
    return _output(fi.fused_moe.cutlass_fused_moe(
        input=hidden_states, token_selected_experts=topk_ids.to(torch.int32).contiguous(),
        token_final_scales=topk_weights.float().contiguous(), output_dtype=hidden_states.dtype,
        quant_scales=[], activation_type=activation_type, **experts.weights,
    ))
