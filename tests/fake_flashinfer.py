"""Checkers standing in for FlashInfer's MoE entry points, as flashinfer-python 0.7.2.post1 publishes them.

Each kernel stand-in is a Python function with the published signature (so a misspelled, missing or
extra keyword fails the call), validates shapes, dtypes, layouts and enum values as the docs state,
checks that the weights passed are the very view FlashInfer's `prepare_weights` returned, and then
computes the documented semantics in float32:
- GEMM1 rows are [up; gate]: "Let GEMM1 output be split as X1 (linear/up half) and X2 (gate half)",
  SwiGLU = X2 * sigmoid(X2) * X1 (trtllm_bf16_moe docs; cutlass: `w3, w1 = chunk(w31)` in
  FlashInfer's own test reference).
- routing methods as RoutingMethodType documents them (Default: softmax -> top-k; Renormalize:
  top-k -> softmax; SigmoidRenorm: sigmoid -> top-k -> renormalise; Sigmoid; TopK: as given).
The BlockMajorK view is emulated without the row shuffles ([K / 64, Mn, 64] bf16 = 128-byte blocks),
and NVFP4 "quantization" keeps the bf16 originals aside, so the stand-ins can compute a result.

`install(monkeypatch)` puts the fake modules in sys.modules as flashinfer, flashinfer.fused_moe and
flashinfer.tllm_enums; `modules()` returns them for functions that take them as an argument.
"""
from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_triton.backends.flashinfer import FlashInferModules


# ---- flashinfer.tllm_enums (values of 0.7.2.post1) -----------------------------------------------

class RoutingMethodType(enum.IntEnum):
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    SigmoidRenorm = 6
    MiniMax2 = 7
    Sigmoid = 8
    TopKSigmoid = 9
    Unspecified = 10


class ActivationType(enum.IntEnum):
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9


class WeightLayout(enum.IntEnum):
    MajorK = 0
    MajorMn = 1
    BlockMajorK = 2


class SfLayout(enum.IntEnum):
    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


# ---- typed activation values (flashinfer.fused_moe.SwiGLU / ReLU2) -------------------------------

@dataclass(frozen=True)
class SwiGLU:
    is_gated = True


@dataclass(frozen=True)
class ReLU2:
    is_gated = False


# ---- prepared views: what prepare_weights returned, to check the kernels get exactly that ---------

@dataclass
class Prepared:
    kind: str  # "trtllm_bf16", "trtllm_fp4", "cutlass_bf16"
    w1: torch.Tensor  # [E, 2I or I, H] float32, [up; gate] as handed to prepare_weights
    w2: torch.Tensor  # [E, H, I] float32
    gated: bool
    view: dict  # the tensors returned, under FlashInfer's keyword names


PREPARED: dict[int, Prepared] = {}  # id(first weight tensor of the view) -> what it holds
ACTIVATIONS: dict[int, torch.Tensor] = {}  # id(NVFP4 hidden states) -> the bf16 originals
CALLS: list[tuple[str, dict]] = []


def _check(condition: bool, message: str):
    if not condition:
        raise AssertionError(f"FlashInfer contract: {message}")


def _check_geometry(kind, w1, w2, num_local_experts, hidden_size, intermediate_size, activation, device):
    _check(w1.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16, f"{kind} expects bf16 weights")
    _check(isinstance(activation, (SwiGLU, ReLU2)), f"activation must be a typed value, got {activation!r}")
    rows = intermediate_size * (2 if activation.is_gated else 1)
    _check(tuple(w1.shape) == (num_local_experts, rows, hidden_size), f"w1 {tuple(w1.shape)} != {(num_local_experts, rows, hidden_size)}")
    _check(tuple(w2.shape) == (num_local_experts, hidden_size, intermediate_size), f"w2 {tuple(w2.shape)}")
    _check(w1.is_contiguous() and w2.is_contiguous(), "weights must be contiguous")
    _check(torch.device(device) == w1.device, "device must be the weights' device")
    return rows


def _block_major_k(w: torch.Tensor) -> torch.Tensor:
    E, M, K = w.shape  # bf16: a 128-byte block is 64 elements
    _check(M % 128 == 0, f"{M} rows is not a multiple of epilogue_tile_m=128")
    _check(K % 64 == 0, f"K={K} is not a whole number of 128-byte blocks")
    return w.view(E, M, K // 64, 64).permute(0, 2, 1, 3).contiguous()  # [E, K/64, M, 64]


def _register(view: dict, kind: str, w1, w2, gated: bool) -> dict:
    PREPARED[id(next(iter(view.values())))] = Prepared(kind, w1.float(), w2.float(), gated, view)
    return view


class TrtllmBf16Config:
    @staticmethod
    def prepare_weights(w1_bf16, w2_bf16, *, num_local_experts, hidden_size, intermediate_size, activation=None,
                        device=None, permute_cache=None):
        _check_geometry("TrtllmBf16Config", w1_bf16, w2_bf16, num_local_experts, hidden_size, intermediate_size,
                        activation, device)
        view = {"gemm1_weights": _block_major_k(w1_bf16), "gemm2_weights": _block_major_k(w2_bf16)}
        return _register(view, "trtllm_bf16", w1_bf16, w2_bf16, activation.is_gated)


class CutlassBf16Config:
    @staticmethod
    def prepare_weights(w1_bf16, w2_bf16, *, num_local_experts, hidden_size, intermediate_size, activation=None,
                        device=None):
        _check_geometry("CutlassBf16Config", w1_bf16, w2_bf16, num_local_experts, hidden_size, intermediate_size,
                        activation, device)
        _check(intermediate_size % 16 == 0, f"CUTLASS MoE needs I % 16 == 0, got {intermediate_size}")
        view = {"fc1_expert_weights": w1_bf16.contiguous(), "fc2_expert_weights": w2_bf16.contiguous()}
        return _register(view, "cutlass_bf16", w1_bf16, w2_bf16, activation.is_gated)


class TrtllmFp4Config:
    @staticmethod
    def prepare_weights(w1_bf16, w2_bf16, *, quant=None, num_local_experts, hidden_size, intermediate_size,
                        activation=None, device=None, permute_cache=None):
        rows = _check_geometry("TrtllmFp4Config", w1_bf16, w2_bf16, num_local_experts, hidden_size,
                               intermediate_size, activation, device)
        _check(quant is None, "NVFP4 x NVFP4 is the default pair")
        _check(hidden_size % 16 == 0 and intermediate_size % 16 == 0, "NVFP4 needs H, I divisible by 16")
        _check(rows % 128 == 0, f"GEMM1 rows {rows} not divisible by 128")
        E, H, I = num_local_experts, hidden_size, intermediate_size
        ones = torch.ones(E, dtype=torch.float32)
        view = {
            "gemm1_weights": torch.zeros(E, rows, H // 2, dtype=torch.uint8),
            "gemm1_weights_scale": torch.zeros(E, rows, H // 16, dtype=torch.float8_e4m3fn),
            "gemm2_weights": torch.zeros(E, H, I // 2, dtype=torch.uint8),
            "gemm2_weights_scale": torch.zeros(E, H, I // 16, dtype=torch.float8_e4m3fn),
            "output1_scale_scalar": ones, "output1_scale_gate_scalar": ones, "output2_scale_scalar": ones,
        }
        if activation.is_gated:
            view["gemm1_alpha"] = ones
        return _register(view, "trtllm_fp4", w1_bf16, w2_bf16, activation.is_gated)

    @staticmethod
    def prepare_activations(hidden_states_bf16, *, quant=None):
        _check(hidden_states_bf16.dim() == 2 and hidden_states_bf16.dtype == torch.bfloat16, "activations: 2-D bf16")
        T, H = hidden_states_bf16.shape
        q = torch.zeros(T, H // 2, dtype=torch.uint8)
        ACTIVATIONS[id(q)] = hidden_states_bf16.float()
        return q, torch.zeros(T, H // 16, dtype=torch.float8_e4m3fn)


# ---- the documented semantics --------------------------------------------------------------------

def _route(logits: torch.Tensor, top_k: int, method: RoutingMethodType, norm_topk_prob: bool):
    logits = logits.float()
    if method is RoutingMethodType.Default:  # softmax over all, then top-k
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    elif method in (RoutingMethodType.Renormalize, RoutingMethodType.RenormalizeNaive):  # top-k, softmax over k
        top, ids = logits.topk(top_k, -1)
        weights = torch.softmax(top, -1)
    elif method in (RoutingMethodType.SigmoidRenorm, RoutingMethodType.Sigmoid):
        weights, ids = torch.sigmoid(logits).topk(top_k, -1)
        if method is RoutingMethodType.SigmoidRenorm and norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        raise AssertionError(f"FlashInfer contract: routing method {method!r} not emulated")
    return ids, weights


def _experts(x: torch.Tensor, prepared: Prepared, activation_type, ids, weights) -> torch.Tensor:
    _check(activation_type in (ActivationType.Swiglu, ActivationType.Relu2), f"activation_type {activation_type}")
    _check((activation_type == ActivationType.Swiglu) == prepared.gated, "activation_type vs prepared gating")
    x = x.float()
    out = torch.zeros(x.shape[0], prepared.w2.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = prepared.w1[e] @ x[t]  # [2I] or [I]
            if prepared.gated:
                up, gate = h.chunk(2)  # X1 = linear/up half, X2 = gate half
                h = F.silu(gate) * up
            else:
                h = torch.relu(h).square()
            out[t] += float(weights[t, k]) * (prepared.w2[e] @ h)
    return out


def _prepared(kind: str, **tensors: torch.Tensor) -> Prepared:
    prepared = PREPARED.get(id(next(iter(tensors.values()))))
    _check(prepared is not None and prepared.kind == kind, f"weights are not the {kind} view prepare_weights returned")
    for name, tensor in tensors.items():
        _check(tensor is prepared.view[name], f"{name} is not the prepared tensor of that name")
    return prepared


def _check_trtllm_common(prepared, num_experts, top_k, n_group, topk_group, intermediate_size, local_expert_offset,
                         local_num_experts, routed_scaling_factor, routing_method_type, do_finalize):
    E, I = prepared.w2.shape[0], prepared.w2.shape[2]
    _check(num_experts == E and local_num_experts == E and local_expert_offset == 0, "expert counts / offset")
    _check(intermediate_size == I, f"intermediate_size {intermediate_size} != prepared I {I}")
    _check(1 <= top_k <= E, f"top_k {top_k}")
    _check(n_group is None and topk_group is None, "grouping only with DeepSeekV3")
    _check(routed_scaling_factor is None, "no routed scaling for these methods")
    _check(do_finalize is True, "do_finalize=True returns the output")
    return RoutingMethodType(routing_method_type)


def _check_bf16_layout(hidden_states, use_shuffled_weight, weight_layout, prepared):
    _check(hidden_states.dtype == torch.bfloat16 and hidden_states.dim() == 2, "hidden_states (T, H) bf16")
    _check(hidden_states.shape[1] == prepared.w2.shape[1], "hidden size")
    _check(use_shuffled_weight is True and weight_layout == WeightLayout.BlockMajorK, "BlockMajorK, shuffled")


def _check_routed_ids(topk_ids, num_tokens, top_k, num_experts):
    _check(isinstance(topk_ids, tuple) and len(topk_ids) == 2, "the unpacked (topk_ids, topk_weights) form")
    ids, weights = topk_ids
    _check(ids.dtype == torch.int32 and tuple(ids.shape) == (num_tokens, top_k), f"topk_ids int32 {ids.dtype} {tuple(ids.shape)}")
    _check(weights.dtype in (torch.float32, torch.bfloat16) and weights.shape == ids.shape, "topk_weights f32/bf16")
    _check(ids.is_contiguous() and weights.is_contiguous(), "routing tensors contiguous")
    _check(bool(((ids >= 0) & (ids < num_experts)).all()), "expert ids in range")
    return ids, weights


def trtllm_bf16_moe(routing_logits, routing_bias, hidden_states, gemm1_weights, gemm2_weights, num_experts, top_k,
                    n_group, topk_group, intermediate_size, local_expert_offset, local_num_experts,
                    routed_scaling_factor=None, routing_method_type=0, use_shuffled_weight=True,
                    weight_layout=WeightLayout.BlockMajorK, do_finalize=True, enable_pdl=True,
                    tune_max_num_tokens=8192, activation_type=ActivationType.Swiglu.value, norm_topk_prob=True,
                    routing_replay_out=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, output=None):
    CALLS.append(("trtllm_bf16_moe", dict(locals())))
    prepared = _prepared("trtllm_bf16", gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights)
    method = _check_trtllm_common(prepared, num_experts, top_k, n_group, topk_group, intermediate_size,
                                  local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type,
                                  do_finalize)
    _check_bf16_layout(hidden_states, use_shuffled_weight, weight_layout, prepared)
    _check(routing_logits.dtype in (torch.float32, torch.bfloat16), "routing_logits f32/bf16")
    _check(tuple(routing_logits.shape) == (hidden_states.shape[0], num_experts), "routing_logits (T, E)")
    _check(routing_bias is None, "no routing bias for these methods")
    ids, weights = _route(routing_logits, top_k, method, norm_topk_prob)
    return _experts(hidden_states, prepared, ActivationType(activation_type), ids, weights).to(torch.bfloat16)


def trtllm_bf16_routed_moe(topk_ids, hidden_states, gemm1_weights, gemm2_weights, num_experts, top_k, n_group,
                           topk_group, intermediate_size, local_expert_offset, local_num_experts,
                           routed_scaling_factor=None, routing_method_type=0, use_shuffled_weight=True,
                           weight_layout=WeightLayout.BlockMajorK, do_finalize=True, enable_pdl=True,
                           gemm1_lora_delta=None, tune_max_num_tokens=8192,
                           activation_type=ActivationType.Swiglu.value, routing_replay_out=None, gemm1_alpha=None,
                           gemm1_beta=None, gemm1_clamp_limit=None, output=None):
    CALLS.append(("trtllm_bf16_routed_moe", dict(locals())))
    prepared = _prepared("trtllm_bf16", gemm1_weights=gemm1_weights, gemm2_weights=gemm2_weights)
    method = _check_trtllm_common(prepared, num_experts, top_k, n_group, topk_group, intermediate_size,
                                  local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type,
                                  do_finalize)
    _check(method is RoutingMethodType.TopK, f"precomputed routing is used as given (TopK), got {method!r}")
    _check_bf16_layout(hidden_states, use_shuffled_weight, weight_layout, prepared)
    _check(gemm1_lora_delta is None, "no LoRA delta")
    ids, weights = _check_routed_ids(topk_ids, hidden_states.shape[0], top_k, num_experts)
    return _experts(hidden_states, prepared, ActivationType(activation_type), ids, weights).to(torch.bfloat16)


def _check_fp4(hidden_states, hidden_states_scale, hidden_states_scale_layout, gemm1_weights, gemm1_weights_scale,
               gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights, gemm2_weights_scale, gemm2_bias,
               output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar):
    prepared = _prepared("trtllm_fp4", gemm1_weights=gemm1_weights, gemm1_weights_scale=gemm1_weights_scale,
                         gemm2_weights=gemm2_weights, gemm2_weights_scale=gemm2_weights_scale,
                         output1_scale_scalar=output1_scale_scalar, output2_scale_scalar=output2_scale_scalar)
    E, H, I = prepared.w2.shape
    rows = prepared.w1.shape[1]
    x = ACTIVATIONS.get(id(hidden_states))
    _check(x is not None, "hidden_states are the NVFP4 activations prepare_activations returned")
    T = x.shape[0]
    _check(hidden_states.dtype == torch.uint8 and tuple(hidden_states.shape) == (T, H // 2), "packed fp4 hidden states")
    _check(hidden_states_scale.dtype == torch.float8_e4m3fn and tuple(hidden_states_scale.shape) == (T, H // 16),
           "hidden_states_scale (T, H/16) e4m3")
    _check(hidden_states_scale_layout == SfLayout.layout_linear, "prepare_activations writes the linear layout")
    _check(tuple(gemm1_weights.shape) == (E, rows, H // 2) and gemm1_weights_scale.dtype == torch.float8_e4m3fn,
           "gemm1 fp4 weights and e4m3 scales")
    _check(tuple(gemm2_weights.shape) == (E, H, I // 2) and tuple(gemm2_weights_scale.shape) == (E, H, I // 16),
           "gemm2 fp4 weights and scales")
    for scalar in (output1_scale_scalar, output1_scale_gate_scalar, output2_scale_scalar):
        _check(scalar.dtype == torch.float32 and tuple(scalar.shape) == (E,), "per-expert float32 output scales")
    _check((gemm1_alpha is not None) == prepared.gated, "gemm1_alpha exactly for gated NVFP4")
    _check(gemm1_bias is None and gemm2_bias is None and gemm1_beta is None and gemm1_clamp_limit is None,
           "no biases, no SwiGLU beta / clamp")
    return prepared, x


def trtllm_fp4_block_scale_moe(routing_logits, routing_bias, hidden_states, hidden_states_scale, gemm1_weights,
                               gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                               gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                               output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, n_group,
                               topk_group, intermediate_size, local_expert_offset, local_num_experts,
                               routed_scaling_factor, routing_method_type=0, do_finalize=True, enable_pdl=None,
                               activation_type=ActivationType.Swiglu.value, per_token_scale=None, output=None,
                               tune_max_num_tokens=8192, norm_topk_prob=True, routing_replay_out=None,
                               num_fused_shared_experts=None, valid_hidden_size=None, valid_intermediate_size=None,
                               hidden_states_scale_layout=None):
    CALLS.append(("trtllm_fp4_block_scale_moe", dict(locals())))
    prepared, x = _check_fp4(hidden_states, hidden_states_scale, hidden_states_scale_layout, gemm1_weights,
                             gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights,
                             gemm2_weights_scale, gemm2_bias, output1_scale_scalar, output1_scale_gate_scalar,
                             output2_scale_scalar)
    method = _check_trtllm_common(prepared, num_experts, top_k, n_group, topk_group, intermediate_size,
                                  local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type,
                                  do_finalize)
    _check(routing_bias is None and tuple(routing_logits.shape) == (x.shape[0], num_experts), "routing_logits (T, E)")
    ids, weights = _route(routing_logits, top_k, method, norm_topk_prob)
    return [_experts(x, prepared, ActivationType(activation_type), ids, weights).to(torch.bfloat16)]


def trtllm_fp4_block_scale_routed_moe(topk_ids, routing_bias, hidden_states, hidden_states_scale, gemm1_weights,
                                      gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit,
                                      gemm2_weights, gemm2_weights_scale, gemm2_bias, output1_scale_scalar,
                                      output1_scale_gate_scalar, output2_scale_scalar, num_experts, top_k, n_group,
                                      topk_group, intermediate_size, local_expert_offset, local_num_experts,
                                      routed_scaling_factor, routing_method_type=0, do_finalize=True, enable_pdl=None,
                                      activation_type=ActivationType.Swiglu.value, per_token_scale=None, output=None,
                                      tune_max_num_tokens=8192, gemm1_lora_delta=None, valid_hidden_size=None,
                                      valid_intermediate_size=None, num_fused_shared_experts=None,
                                      hidden_states_scale_layout=None):
    CALLS.append(("trtllm_fp4_block_scale_routed_moe", dict(locals())))
    prepared, x = _check_fp4(hidden_states, hidden_states_scale, hidden_states_scale_layout, gemm1_weights,
                             gemm1_weights_scale, gemm1_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit, gemm2_weights,
                             gemm2_weights_scale, gemm2_bias, output1_scale_scalar, output1_scale_gate_scalar,
                             output2_scale_scalar)
    method = _check_trtllm_common(prepared, num_experts, top_k, n_group, topk_group, intermediate_size,
                                  local_expert_offset, local_num_experts, routed_scaling_factor, routing_method_type,
                                  do_finalize)
    _check(method is RoutingMethodType.TopK and routing_bias is None, "precomputed routing used as given")
    ids, weights = _check_routed_ids(topk_ids, x.shape[0], top_k, num_experts)
    return [_experts(x, prepared, ActivationType(activation_type), ids, weights).to(torch.bfloat16)]


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
                      swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
                      ep_rank=0, cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
                      use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False, use_mxfp8_act_scaling=False,
                      min_latency_mode=False, use_packed_weights=False, use_wfp4afp8_humming=False,
                      tune_max_num_tokens=8192, enable_pdl=None, activation_type=ActivationType.Swiglu,
                      swizzled_input_sf=True, use_fused_finalize=True, profile_ids=None, workspace_buffer=None, *,
                      clamped_relu2_limit=None, situ_beta=None, situ_linear_beta=None, backend="cutlass"):
    CALLS.append(("cutlass_fused_moe", dict(locals())))
    prepared = _prepared("cutlass_bf16", fc1_expert_weights=fc1_expert_weights, fc2_expert_weights=fc2_expert_weights)
    E, H, I = prepared.w2.shape
    _check(input.dim() == 2 and input.shape[1] == H and input.dtype == torch.bfloat16, "input (T, H) bf16")
    _check(tuple(fc2_expert_weights.shape) == (E, H, I), "fc2 (E, H, I)")
    _check(output_dtype == input.dtype, "output_dtype")
    _check(quant_scales == [] or quant_scales is None, "no quant scales for bf16")
    _check(isinstance(activation_type, ActivationType), "activation_type is an ActivationType")
    _check(fc1_expert_biases is None and fc2_expert_biases is None and swiglu_alpha is None, "no biases / swiglu params")
    _check(not enable_alltoall and (tp_size, ep_size) == (1, 1), "no all-to-all, no parallelism")
    _check(token_final_scales.dtype == torch.float32, "token_final_scales float32")
    ids, weights = _check_routed_ids((token_selected_experts, token_final_scales), input.shape[0],
                                     token_selected_experts.shape[1], E)
    return _experts(input, prepared, activation_type, ids, weights).to(output_dtype)


# ---- the modules --------------------------------------------------------------------------------

def _module(name: str, **members) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    return module


fused_moe = _module(
    "flashinfer.fused_moe", SwiGLU=SwiGLU, ReLU2=ReLU2, TrtllmBf16Config=TrtllmBf16Config,
    CutlassBf16Config=CutlassBf16Config, TrtllmFp4Config=TrtllmFp4Config, trtllm_bf16_moe=trtllm_bf16_moe,
    trtllm_bf16_routed_moe=trtllm_bf16_routed_moe, trtllm_fp4_block_scale_moe=trtllm_fp4_block_scale_moe,
    trtllm_fp4_block_scale_routed_moe=trtllm_fp4_block_scale_routed_moe, cutlass_fused_moe=cutlass_fused_moe,
)
tllm_enums = _module("flashinfer.tllm_enums", RoutingMethodType=RoutingMethodType, ActivationType=ActivationType,
                     WeightLayout=WeightLayout, SfLayout=SfLayout)


def modules() -> FlashInferModules:
    return FlashInferModules(fused_moe, tllm_enums)


def install(monkeypatch) -> list[tuple[str, dict]]:
    """Make `import flashinfer.fused_moe` / `flashinfer.tllm_enums` find the checkers; returns the call log."""
    monkeypatch.setitem(sys.modules, "flashinfer", _module("flashinfer", fused_moe=fused_moe, tllm_enums=tllm_enums))
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setitem(sys.modules, "flashinfer.tllm_enums", tllm_enums)
    CALLS.clear()
    return CALLS
