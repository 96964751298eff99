"""Checkers standing in for FlashInfer's MoE entry points, as flashinfer-python 0.7.2.post1
publishes them.

SIGNATURES is the table of published parameter lists. `@stand_in(name)` makes each entry point from
it alike: the call is bound against that signature (so a misspelled, missing or extra keyword fails
exactly as a real call would), kernel calls are logged in CALLS, and the bound arguments go to the
decorated function, which holds only that entry's own checks (shapes, dtypes, layouts and enum
values as the docs state; that the weights are the very view `prepare_weights` returned) and its
float32 semantics:
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
import inspect
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_triton.runners.flashinfer import FlashInferModules

# ---- flashinfer.tllm_enums (0.7.2.post1: each member's value is its position, from 0) ------------

RoutingMethodType = enum.IntEnum("RoutingMethodType",
                                 "Default Renormalize DeepSeekV3 Llama4 RenormalizeNaive TopK "
                                 "SigmoidRenorm MiniMax2 Sigmoid TopKSigmoid Unspecified", start=0)
ActivationType = enum.IntEnum("ActivationType",
                              "Gelu Relu Silu Swiglu Geglu SwigluBias Relu2 SwigluStep GegluTanh "
                              "Identity", start=0)
WeightLayout = enum.IntEnum("WeightLayout", "MajorK MajorMn BlockMajorK", start=0)
SfLayout = enum.IntEnum("SfLayout", "layout_128x4 layout_8x4 layout_linear", start=0)


# ---- typed activation values (flashinfer.fused_moe.SwiGLU / ReLU2) -------------------------------

@dataclass(frozen=True)
class SwiGLU:
    is_gated = True


@dataclass(frozen=True)
class ReLU2:
    is_gated = False


# ---- the published signatures -------------------------------------------------------------------
# In order: a string names required parameters, a dict gives defaulted ones, "*" makes the rest
# keyword-only.

_PREPARE_WEIGHTS = ("w1_bf16 w2_bf16", "*", "num_local_experts hidden_size intermediate_size")
_EXPERT_COUNTS = ("num_experts top_k n_group topk_group intermediate_size local_expert_offset "
                  "local_num_experts")
_FP4_COMMON = (  # what both fp4 kernels take after their first two parameters
    "hidden_states hidden_states_scale gemm1_weights gemm1_weights_scale gemm1_bias gemm1_alpha "
    "gemm1_beta gemm1_clamp_limit gemm2_weights gemm2_weights_scale gemm2_bias "
    "output1_scale_scalar output1_scale_gate_scalar output2_scale_scalar", _EXPERT_COUNTS,
    "routed_scaling_factor",
    dict(routing_method_type=0, do_finalize=True, enable_pdl=None,
         activation_type=ActivationType.Swiglu.value, per_token_scale=None, output=None,
         tune_max_num_tokens=8192))

SIGNATURES = {
    "TrtllmBf16Config.prepare_weights": (*_PREPARE_WEIGHTS,
                                         dict(activation=None, device=None, permute_cache=None)),
    "CutlassBf16Config.prepare_weights": (*_PREPARE_WEIGHTS, dict(activation=None, device=None)),
    "TrtllmFp4Config.prepare_weights": ("w1_bf16 w2_bf16", "*", dict(quant=None),
                                        "num_local_experts hidden_size intermediate_size",
                                        dict(activation=None, device=None, permute_cache=None)),
    "TrtllmFp4Config.prepare_activations": ("hidden_states_bf16", "*", dict(quant=None)),
    "trtllm_bf16_moe": (
        "routing_logits routing_bias hidden_states gemm1_weights gemm2_weights", _EXPERT_COUNTS,
        dict(routed_scaling_factor=None, routing_method_type=0, use_shuffled_weight=True,
             weight_layout=WeightLayout.BlockMajorK, do_finalize=True, enable_pdl=True,
             tune_max_num_tokens=8192, activation_type=ActivationType.Swiglu.value,
             norm_topk_prob=True, routing_replay_out=None, gemm1_alpha=None, gemm1_beta=None,
             gemm1_clamp_limit=None, output=None)),
    "trtllm_bf16_routed_moe": (
        "topk_ids hidden_states gemm1_weights gemm2_weights", _EXPERT_COUNTS,
        dict(routed_scaling_factor=None, routing_method_type=0, use_shuffled_weight=True,
             weight_layout=WeightLayout.BlockMajorK, do_finalize=True, enable_pdl=True,
             gemm1_lora_delta=None, tune_max_num_tokens=8192,
             activation_type=ActivationType.Swiglu.value, routing_replay_out=None, gemm1_alpha=None,
             gemm1_beta=None, gemm1_clamp_limit=None, output=None)),
    "trtllm_fp4_block_scale_moe": (
        "routing_logits routing_bias", *_FP4_COMMON,
        dict(norm_topk_prob=True, routing_replay_out=None, num_fused_shared_experts=None,
             valid_hidden_size=None, valid_intermediate_size=None,
             hidden_states_scale_layout=None)),
    "trtllm_fp4_block_scale_routed_moe": (
        "topk_ids routing_bias", *_FP4_COMMON,
        dict(gemm1_lora_delta=None, valid_hidden_size=None, valid_intermediate_size=None,
             num_fused_shared_experts=None, hidden_states_scale_layout=None)),
    "cutlass_fused_moe": (
        "input token_selected_experts token_final_scales fc1_expert_weights fc2_expert_weights "
        "output_dtype quant_scales",
        dict(fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None, swiglu_alpha=None,
             swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0,
             cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
             use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False,
             use_mxfp8_act_scaling=False, min_latency_mode=False, use_packed_weights=False,
             use_wfp4afp8_humming=False, tune_max_num_tokens=8192, enable_pdl=None,
             activation_type=ActivationType.Swiglu, swizzled_input_sf=True, use_fused_finalize=True,
             profile_ids=None, workspace_buffer=None),
        "*",
        dict(clamped_relu2_limit=None, situ_beta=None, situ_linear_beta=None, backend="cutlass")),
}

CALLS: list[tuple[str, dict]] = []  # kernel calls: (name, every argument bound, defaults included)


def _signature(params: tuple) -> inspect.Signature:
    kind, parameters = inspect.Parameter.POSITIONAL_OR_KEYWORD, []
    for item in params:
        if item == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        defaults = (item if isinstance(item, dict)
                    else dict.fromkeys(item.split(), inspect.Parameter.empty))
        parameters += [inspect.Parameter(name, kind, default=default)
                       for name, default in defaults.items()]
    return inspect.Signature(parameters)


def stand_in(name: str, record: bool = True):
    """`@stand_in(name)`: entry point `name`, taking its published signature; the decorated
    semantics gets the bound arguments, defaults applied, as attributes of one namespace."""
    signature = _signature(SIGNATURES[name])

    def decorate(semantics):
        def entry_point(*args, **kwargs):
            # a wrong argument list raises TypeError, as a real call does
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if record:
                CALLS.append((name, dict(bound.arguments)))
            return semantics(types.SimpleNamespace(**bound.arguments))

        entry_point.__name__, entry_point.__qualname__, entry_point.__signature__ = (
            semantics.__name__, name, signature)
        return entry_point
    return decorate


# ---- prepared views: what prepare_weights returned, to check the kernels get exactly that --------

@dataclass
class Prepared:
    kind: str  # "trtllm_bf16", "trtllm_fp4", "cutlass_bf16"
    w1: torch.Tensor  # [E, 2I or I, H] float32, [up; gate] as handed to prepare_weights
    w2: torch.Tensor  # [E, H, I] float32
    gated: bool
    view: dict  # the tensors returned, under FlashInfer's keyword names


PREPARED: dict[int, Prepared] = {}  # id(first weight tensor of the view) -> what it holds
ACTIVATIONS: dict[int, torch.Tensor] = {}  # id(NVFP4 hidden states) -> the bf16 originals


def _check(condition: bool, message: str):
    if not condition:
        raise AssertionError(f"FlashInfer contract: {message}")


def _check_geometry(kind: str, args) -> int:
    w1, w2, activation = args.w1_bf16, args.w2_bf16, args.activation
    E, H, I = args.num_local_experts, args.hidden_size, args.intermediate_size
    _check(w1.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16,
           f"{kind} expects bf16 weights")
    _check(isinstance(activation, (SwiGLU, ReLU2)),
           f"activation must be a typed value, got {activation!r}")
    rows = I * (2 if activation.is_gated else 1)
    _check(tuple(w1.shape) == (E, rows, H), f"w1 {tuple(w1.shape)} != {(E, rows, H)}")
    _check(tuple(w2.shape) == (E, H, I), f"w2 {tuple(w2.shape)}")
    _check(w1.is_contiguous() and w2.is_contiguous(), "weights must be contiguous")
    _check(torch.device(args.device) == w1.device, "device must be the weights' device")
    return rows


def _block_major_k(w: torch.Tensor) -> torch.Tensor:
    E, M, K = w.shape  # bf16: a 128-byte block is 64 elements
    _check(M % 128 == 0, f"{M} rows is not a multiple of epilogue_tile_m=128")
    _check(K % 64 == 0, f"K={K} is not a whole number of 128-byte blocks")
    return w.view(E, M, K // 64, 64).permute(0, 2, 1, 3).contiguous()  # [E, K/64, M, 64]


def _register(view: dict, kind: str, args) -> dict:
    gated = args.activation.is_gated
    PREPARED[id(next(iter(view.values())))] = Prepared(kind, args.w1_bf16.float(),
                                                       args.w2_bf16.float(), gated, view)
    return view


@stand_in("TrtllmBf16Config.prepare_weights", record=False)
def _prepare_trtllm_bf16(args):
    _check_geometry("TrtllmBf16Config", args)
    view = {"gemm1_weights": _block_major_k(args.w1_bf16),
            "gemm2_weights": _block_major_k(args.w2_bf16)}
    return _register(view, "trtllm_bf16", args)


@stand_in("CutlassBf16Config.prepare_weights", record=False)
def _prepare_cutlass_bf16(args):
    _check_geometry("CutlassBf16Config", args)
    _check(args.intermediate_size % 16 == 0,
           f"CUTLASS MoE needs I % 16 == 0, got {args.intermediate_size}")
    view = {"fc1_expert_weights": args.w1_bf16.contiguous(),
            "fc2_expert_weights": args.w2_bf16.contiguous()}
    return _register(view, "cutlass_bf16", args)


@stand_in("TrtllmFp4Config.prepare_weights", record=False)
def _prepare_trtllm_fp4(args):
    rows = _check_geometry("TrtllmFp4Config", args)
    E, H, I = args.num_local_experts, args.hidden_size, args.intermediate_size
    _check(args.quant is None, "NVFP4 x NVFP4 is the default pair")
    _check(H % 16 == 0 and I % 16 == 0, "NVFP4 needs H, I divisible by 16")
    _check(rows % 128 == 0, f"GEMM1 rows {rows} not divisible by 128")
    ones = torch.ones(E, dtype=torch.float32)
    view = {
        "gemm1_weights": torch.zeros(E, rows, H // 2, dtype=torch.uint8),
        "gemm1_weights_scale": torch.zeros(E, rows, H // 16, dtype=torch.float8_e4m3fn),
        "gemm2_weights": torch.zeros(E, H, I // 2, dtype=torch.uint8),
        "gemm2_weights_scale": torch.zeros(E, H, I // 16, dtype=torch.float8_e4m3fn),
        "output1_scale_scalar": ones, "output1_scale_gate_scalar": ones,
        "output2_scale_scalar": ones,
    }
    if args.activation.is_gated:
        view["gemm1_alpha"] = ones
    return _register(view, "trtllm_fp4", args)


@stand_in("TrtllmFp4Config.prepare_activations", record=False)
def _prepare_fp4_activations(args):
    x = args.hidden_states_bf16
    _check(x.dim() == 2 and x.dtype == torch.bfloat16, "activations: 2-D bf16")
    T, H = x.shape
    q = torch.zeros(T, H // 2, dtype=torch.uint8)
    ACTIVATIONS[id(q)] = x.float()
    return q, torch.zeros(T, H // 16, dtype=torch.float8_e4m3fn)


TrtllmBf16Config = types.SimpleNamespace(prepare_weights=_prepare_trtllm_bf16)
CutlassBf16Config = types.SimpleNamespace(prepare_weights=_prepare_cutlass_bf16)
TrtllmFp4Config = types.SimpleNamespace(prepare_weights=_prepare_trtllm_fp4,
                                        prepare_activations=_prepare_fp4_activations)


# ---- the documented semantics --------------------------------------------------------------------

def _route(logits: torch.Tensor, top_k: int, method: RoutingMethodType, norm_topk_prob: bool):
    logits = logits.float()
    if method is RoutingMethodType.Default:  # softmax over all, then top-k
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    elif method in (RoutingMethodType.Renormalize, RoutingMethodType.RenormalizeNaive):
        # top-k, softmax over k
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
    _check(activation_type in (ActivationType.Swiglu, ActivationType.Relu2),
           f"activation_type {activation_type}")
    _check((activation_type == ActivationType.Swiglu) == prepared.gated,
           "activation_type vs prepared gating")
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


def _prepared(kind: str, args, *names: str) -> Prepared:
    """What prepare_weights recorded for the view these arguments come from; each must be that very
    tensor."""
    prepared = PREPARED.get(id(getattr(args, names[0])))
    _check(prepared is not None and prepared.kind == kind,
           f"weights are not the {kind} view prepare_weights returned")
    for name in names:
        _check(getattr(args, name) is prepared.view[name],
               f"{name} is not the prepared tensor of that name")
    return prepared


def _trtllm_routing(args, prepared: Prepared, num_tokens: int):
    """(ids, weights): routed from the logits as routing_method_type names, or the routed calls'
    top-k as given."""
    E, I = prepared.w2.shape[0], prepared.w2.shape[2]
    _check(args.num_experts == E and args.local_num_experts == E and args.local_expert_offset == 0,
           "expert counts / offset")
    _check(args.intermediate_size == I,
           f"intermediate_size {args.intermediate_size} != prepared I {I}")
    _check(1 <= args.top_k <= E, f"top_k {args.top_k}")
    _check(args.n_group is None and args.topk_group is None, "grouping only with DeepSeekV3")
    _check(args.routed_scaling_factor is None, "no routed scaling for these methods")
    _check(args.do_finalize is True, "do_finalize=True returns the output")
    method = RoutingMethodType(args.routing_method_type)
    if "topk_ids" in vars(args):  # trtllm_*_routed_moe
        _check(method is RoutingMethodType.TopK,
               f"precomputed routing is used as given (TopK), got {method!r}")
        return _check_routed_ids(args.topk_ids, num_tokens, args.top_k, args.num_experts)
    _check(args.routing_logits.dtype in (torch.float32, torch.bfloat16), "routing_logits f32/bf16")
    _check(tuple(args.routing_logits.shape) == (num_tokens, args.num_experts),
           "routing_logits (T, E)")
    _check(args.routing_bias is None, "no routing bias for these methods")
    return _route(args.routing_logits, args.top_k, method, args.norm_topk_prob)


def _check_bf16(args) -> Prepared:
    """The bf16 operands both bf16 kernels take; returns what was prepared."""
    prepared = _prepared("trtllm_bf16", args, "gemm1_weights", "gemm2_weights")
    x = args.hidden_states
    _check(x.dtype == torch.bfloat16 and x.dim() == 2, "hidden_states (T, H) bf16")
    _check(x.shape[1] == prepared.w2.shape[1], "hidden size")
    _check(args.use_shuffled_weight is True and args.weight_layout == WeightLayout.BlockMajorK,
           "BlockMajorK, shuffled")
    return prepared


def _check_routed_ids(topk_ids, num_tokens, top_k, num_experts):
    _check(isinstance(topk_ids, tuple) and len(topk_ids) == 2,
           "the unpacked (topk_ids, topk_weights) form")
    ids, weights = topk_ids
    _check(ids.dtype == torch.int32 and tuple(ids.shape) == (num_tokens, top_k),
           f"topk_ids int32 {ids.dtype} {tuple(ids.shape)}")
    _check(weights.dtype in (torch.float32, torch.bfloat16) and weights.shape == ids.shape,
           "topk_weights f32/bf16")
    _check(ids.is_contiguous() and weights.is_contiguous(), "routing tensors contiguous")
    _check(bool(((ids >= 0) & (ids < num_experts)).all()), "expert ids in range")
    return ids, weights


def _check_fp4(args) -> tuple[Prepared, torch.Tensor]:
    """The NVFP4 operands both fp4 kernels take; returns what was prepared and the bf16
    activations."""
    prepared = _prepared("trtllm_fp4", args, "gemm1_weights", "gemm1_weights_scale",
                         "gemm2_weights", "gemm2_weights_scale", "output1_scale_scalar",
                         "output2_scale_scalar")
    E, H, I = prepared.w2.shape
    rows = prepared.w1.shape[1]
    x = ACTIVATIONS.get(id(args.hidden_states))
    _check(x is not None, "hidden_states are the NVFP4 activations prepare_activations returned")
    T, scale = x.shape[0], args.hidden_states_scale
    _check(args.hidden_states.dtype == torch.uint8
           and tuple(args.hidden_states.shape) == (T, H // 2), "packed fp4 hidden states")
    _check(scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (T, H // 16),
           "hidden_states_scale (T, H/16) e4m3")
    _check(args.hidden_states_scale_layout == SfLayout.layout_linear,
           "prepare_activations writes the linear layout")
    w1, w1_scale = args.gemm1_weights, args.gemm1_weights_scale
    w2, w2_scale = args.gemm2_weights, args.gemm2_weights_scale
    _check(tuple(w1.shape) == (E, rows, H // 2) and w1_scale.dtype == torch.float8_e4m3fn,
           "gemm1 fp4 weights and e4m3 scales")
    _check(tuple(w2.shape) == (E, H, I // 2) and tuple(w2_scale.shape) == (E, H, I // 16),
           "gemm2 fp4 weights and scales")
    for scalar in (args.output1_scale_scalar, args.output1_scale_gate_scalar,
                   args.output2_scale_scalar):
        _check(scalar.dtype == torch.float32 and tuple(scalar.shape) == (E,),
               "per-expert float32 output scales")
    _check((args.gemm1_alpha is not None) == prepared.gated, "gemm1_alpha exactly for gated NVFP4")
    _check(args.gemm1_bias is None and args.gemm2_bias is None and args.gemm1_beta is None
           and args.gemm1_clamp_limit is None, "no biases, no SwiGLU beta / clamp")
    return prepared, x


# ---- the kernels ---------------------------------------------------------------------------------

@stand_in("trtllm_bf16_moe")
def trtllm_bf16_moe(args):
    prepared = _check_bf16(args)
    ids, weights = _trtllm_routing(args, prepared, len(args.hidden_states))
    return _experts(args.hidden_states, prepared, ActivationType(args.activation_type), ids,
                    weights).to(torch.bfloat16)


@stand_in("trtllm_bf16_routed_moe")
def trtllm_bf16_routed_moe(args):
    prepared = _check_bf16(args)
    _check(args.gemm1_lora_delta is None, "no LoRA delta")
    ids, weights = _trtllm_routing(args, prepared, len(args.hidden_states))
    return _experts(args.hidden_states, prepared, ActivationType(args.activation_type), ids,
                    weights).to(torch.bfloat16)


@stand_in("trtllm_fp4_block_scale_moe")
def trtllm_fp4_block_scale_moe(args):
    prepared, x = _check_fp4(args)
    ids, weights = _trtllm_routing(args, prepared, len(x))
    return [_experts(x, prepared, ActivationType(args.activation_type), ids,
                     weights).to(torch.bfloat16)]


@stand_in("trtllm_fp4_block_scale_routed_moe")
def trtllm_fp4_block_scale_routed_moe(args):
    prepared, x = _check_fp4(args)
    _check(args.routing_bias is None, "precomputed routing used as given")
    ids, weights = _trtllm_routing(args, prepared, len(x))
    return [_experts(x, prepared, ActivationType(args.activation_type), ids,
                     weights).to(torch.bfloat16)]


@stand_in("cutlass_fused_moe")
def cutlass_fused_moe(args):
    prepared = _prepared("cutlass_bf16", args, "fc1_expert_weights", "fc2_expert_weights")
    E, H, I = prepared.w2.shape
    x = args.input
    _check(x.dim() == 2 and x.shape[1] == H and x.dtype == torch.bfloat16, "input (T, H) bf16")
    _check(tuple(args.fc2_expert_weights.shape) == (E, H, I), "fc2 (E, H, I)")
    _check(args.output_dtype == x.dtype, "output_dtype")
    _check(args.quant_scales == [] or args.quant_scales is None, "no quant scales for bf16")
    _check(isinstance(args.activation_type, ActivationType), "activation_type is an ActivationType")
    _check(args.fc1_expert_biases is None and args.fc2_expert_biases is None
           and args.swiglu_alpha is None, "no biases / swiglu params")
    _check(not args.enable_alltoall and (args.tp_size, args.ep_size) == (1, 1),
           "no all-to-all, no parallelism")
    _check(args.token_final_scales.dtype == torch.float32, "token_final_scales float32")
    ids, weights = _check_routed_ids((args.token_selected_experts, args.token_final_scales),
                                     x.shape[0], args.token_selected_experts.shape[1], E)
    return _experts(x, prepared, args.activation_type, ids, weights).to(args.output_dtype)


# ---- the modules --------------------------------------------------------------------------------

def _module(name: str, **members) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    return module


fused_moe = _module(
    "flashinfer.fused_moe", SwiGLU=SwiGLU, ReLU2=ReLU2, TrtllmBf16Config=TrtllmBf16Config,
    CutlassBf16Config=CutlassBf16Config, TrtllmFp4Config=TrtllmFp4Config,
    trtllm_bf16_moe=trtllm_bf16_moe, trtllm_bf16_routed_moe=trtllm_bf16_routed_moe,
    trtllm_fp4_block_scale_moe=trtllm_fp4_block_scale_moe,
    trtllm_fp4_block_scale_routed_moe=trtllm_fp4_block_scale_routed_moe,
    cutlass_fused_moe=cutlass_fused_moe,
)
tllm_enums = _module("flashinfer.tllm_enums", RoutingMethodType=RoutingMethodType,
                     ActivationType=ActivationType, WeightLayout=WeightLayout, SfLayout=SfLayout)


def modules() -> FlashInferModules:
    return FlashInferModules(fused_moe, tllm_enums)


def install(monkeypatch) -> list[tuple[str, dict]]:
    """Make `import flashinfer.fused_moe` / `flashinfer.tllm_enums` find the checkers; returns the
    call log."""
    monkeypatch.setitem(sys.modules, "flashinfer",
                        _module("flashinfer", fused_moe=fused_moe, tllm_enums=tllm_enums))
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setitem(sys.modules, "flashinfer.tllm_enums", tllm_enums)
    CALLS.clear()
    return CALLS
