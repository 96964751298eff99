"""The backends' table and the one support check, `unsupported_reason`. A new backend is one
runner class and one `BackendSpec` passed to `register_backend`."""
from __future__ import annotations

import torch

from ..activation import ActivationKind
from ..context import ModelContext
from ..platform import (
    FLASHINFER_MIN_VERSION,
    INTERPRETER_DOT_DTYPES,
    Platform,
    interpreter_dot_reason,
    interpreter_hint,
)
from ..quant_config import QuantFormat
from ..weights import Fp8Scaling
from .flashinfer import CutlassRunner, TrtllmRoutedRunner, TrtllmRunner, fused_routing_method
from .runner import TorchRunner, TritonRunner
from .spec import BackendSpec, ExpertBackend, LayerTraits

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TRTLLM_SMS = frozenset({100, 103})  # trtllm-gen cubins: Blackwell datacenter parts only
_BF16_OR_NVFP4 = frozenset({QuantFormat.NONE, QuantFormat.NVFP4})
# Ours take (topk_ids, topk_weights) after any dispatch: every all-to-all and outer LoRA fit.
_OURS = dict(sms=None, flashinfer=False, expert_formats=None, all_to_all=None, lora=True,
             dtypes=_FLOATS, activations=None, intermediate_multiple=1, hidden_multiple=1,
             fused_router=False, weight_formats=frozenset({None, *Fp8Scaling}), fp4=True,
             expert_bias=True)
_FLASHINFER = dict(on_cpu=None, flashinfer=True, lora=False, dtypes=(torch.bfloat16,),
                   activations=frozenset({ActivationKind.SILU_AND_MUL, ActivationKind.RELU2}),
                   all_to_all=frozenset({None}))

SPECS: dict[str, BackendSpec] = {spec.backend: spec for spec in (
    BackendSpec(ExpertBackend.TRITON, on_cpu="interpreter", runner=TritonRunner, fp8_min_sm=89,
                interpreter_dtypes=INTERPRETER_DOT_DTYPES, **_OURS),
    BackendSpec(ExpertBackend.TORCH, on_cpu="always", runner=TorchRunner, fp8_dtypes=_FLOATS,
                **_OURS),
    BackendSpec(ExpertBackend.FLASHINFER_TRTLLM, _TRTLLM_SMS, expert_formats=_BF16_OR_NVFP4,
                intermediate_multiple=128, hidden_multiple=128, fused_router=True,
                runner=TrtllmRunner, **_FLASHINFER),
    BackendSpec(ExpertBackend.FLASHINFER_TRTLLM_ROUTED, _TRTLLM_SMS, expert_formats=_BF16_OR_NVFP4,
                intermediate_multiple=128, hidden_multiple=128, fused_router=False,
                runner=TrtllmRoutedRunner, **_FLASHINFER),
    # the SMs FlashInfer's CUTLASS MoE modules are built for
    BackendSpec(ExpertBackend.FLASHINFER_CUTLASS, frozenset({90, 100, 103, 110, 120, 121}),
                expert_formats=frozenset({QuantFormat.NONE}), intermediate_multiple=16,
                hidden_multiple=16, fused_router=False, runner=CutlassRunner, **_FLASHINFER),
)}


def register_backend(spec: BackendSpec) -> None:
    if spec.backend in SPECS:
        raise ValueError(f"backend {spec.backend!r} is already registered")
    SPECS[spec.backend] = spec


def unsupported_reason(backend: ExpertBackend, platform: Platform, context: ModelContext,
                       layer: LayerTraits | None = None) -> str | None:
    """Why `backend` cannot run here, or None when it can."""
    spec = SPECS[backend]
    for check in (_platform_reason, _flashinfer_reason, _model_reason, _layer_reason):
        reason = check(spec, platform, context, layer)
        if reason:
            return reason
    return None


def _platform_reason(spec: BackendSpec, platform: Platform, context, layer) -> str | None:
    if platform.device_type == "cpu":
        if spec.on_cpu == "always" or (spec.on_cpu == "interpreter" and platform.interpreter):
            return None
        if spec.on_cpu == "interpreter":
            return ("the Triton pipeline runs on CPU only under the interpreter "
                    f"({interpreter_hint()})")
        return "it needs a CUDA GPU"
    if spec.sms is not None and platform.sm not in spec.sms:
        why = " (trtllm-gen is Blackwell SM100/SM103 only)" if spec.sms == _TRTLLM_SMS else ""
        return f"it runs on {', '.join(f'SM{sm}' for sm in sorted(spec.sms))} only{why}"
    return None


def _flashinfer_reason(spec: BackendSpec, platform: Platform, context, layer) -> str | None:
    if not spec.flashinfer:
        return None
    if platform.flashinfer is None:
        return "FlashInfer is not installed (pip install 'moe-triton[flashinfer]')"
    version = platform.flashinfer_version()
    if version is None or version < FLASHINFER_MIN_VERSION:
        minimum = ".".join(map(str, FLASHINFER_MIN_VERSION))
        return (f"FlashInfer {platform.flashinfer} is older than {minimum}, "
                "the API this integration follows")
    return None


def _model_reason(spec: BackendSpec, platform, context: ModelContext, layer) -> str | None:
    quant = context.quantization.experts
    if spec.expert_formats is not None and quant.format not in spec.expert_formats:
        accepted = ", ".join(sorted(fmt.value for fmt in spec.expert_formats))
        return f"it does not take {quant} (accepts {accepted} experts)"
    if spec.all_to_all is not None and context.all_to_all not in spec.all_to_all:
        return (f"all-to-all backend {context.all_to_all!r} "
                "has no fused registration for this path")
    if context.lora and not spec.lora:
        return "LoRA on the experts is not supported by this fused path"
    if context.sharded_experts and spec.flashinfer:
        return ("moe_triton.parallel's shards (local ids, -1 for other ranks' experts) "
                "are not wired to the FlashInfer paths, which have not run sharded")
    return None


def _layer_reason(spec: BackendSpec, platform, context, layer: LayerTraits | None) -> str | None:
    if layer is None:
        return None
    if layer.dtype not in spec.dtypes:
        return f"weights are {layer.dtype}; it takes {', '.join(map(str, spec.dtypes))}"
    if layer.format.fp8 not in spec.weight_formats or (layer.format.fp4 and not spec.fp4):
        return f"it does not run {layer.format} experts"
    if layer.expert_bias and not spec.expert_bias:
        return "it does not add expert biases"
    if layer.format.fp8 is not None:
        if layer.dtype not in spec.fp8_dtypes:
            names = " or ".join(str(dtype).removeprefix("torch.") for dtype in spec.fp8_dtypes)
            return (f"FP8 experts take {names} activations here, "
                    f"not {str(layer.dtype).removeprefix('torch.')}")
        if (spec.fp8_min_sm is not None and platform.sm is not None
                and platform.sm < spec.fp8_min_sm):
            return (f"FP8 experts need FP8 tensor cores (SM{spec.fp8_min_sm} or newer); "
                    "dequantize them to bfloat16 (ExpertWeights.dequantized()) "
                    "for an unquantized layer, or use backend='torch'")
    interpreted = platform.device_type == "cpu" and spec.on_cpu == "interpreter"
    if (interpreted and spec.interpreter_dtypes is not None
            and layer.dtype not in spec.interpreter_dtypes):
        return (f"weights are {layer.dtype}, and "
                f"{interpreter_dot_reason(layer.dtype, layer.format.fp8 is not None)}")
    if spec.activations is not None and layer.activation.kind not in spec.activations:
        return (f"activation {layer.activation.kind.name} is not one it implements "
                f"({sorted(a.name for a in spec.activations)})")
    if layer.hidden_size % spec.hidden_multiple:
        return f"hidden size {layer.hidden_size} is not a multiple of {spec.hidden_multiple}"
    if spec.fused_router and fused_routing_method(layer.routing) is None:
        return f"its in-kernel router cannot compute {layer.routing}; use flashinfer_trtllm_routed"
    return None
