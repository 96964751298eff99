"""The backends as data: names, what a layer requires (`LayerTraits`), what each runs
(`BackendSpec`); the table is catalog.py's, and nothing here imports a runner."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..activation import Activation, ActivationKind
from ..quant_config import QuantFormat
from ..routing import RoutingSpec
from ..weights import NATIVE, Fp8Scaling, WeightFormat


class ExpertBackend(str, enum.Enum):
    """A member equals its name string, so registered backends sit beside them."""

    TRITON = "triton"  # our pipeline
    TORCH = "torch"  # the float32 reference, cast back to the input dtype
    FLASHINFER_TRTLLM = "flashinfer_trtllm"  # trtllm-gen: routing from logits + experts, fused
    FLASHINFER_TRTLLM_ROUTED = "flashinfer_trtllm_routed"  # trtllm-gen on our top-k
    FLASHINFER_CUTLASS = "flashinfer_cutlass"  # FlashInfer's CUTLASS fused MoE on our top-k

    def __str__(self) -> str:
        return self.value


# vLLM's --all2all-backend / SGLang's --moe-a2a-backend names: `resolve --all-to-all` takes them
ALL_TO_ALL_BACKENDS = ("naive", "allgather_reducescatter", "pplx", "deepep",
                       "deepep_high_throughput", "deepep_low_latency", "flashinfer_all2allv",
                       "mooncake")


@dataclass(frozen=True)
class LayerTraits:
    hidden_size: int  # the experts' H
    dtype: torch.dtype  # the activations' dtype (the weights' too, unless `format` quantizes)
    activation: Activation
    routing: RoutingSpec
    format: WeightFormat = NATIVE  # how the expert weights are stored
    expert_bias: bool = False  # biases on the expert projections (gpt-oss)


@dataclass(frozen=True)
class BackendSpec:
    backend: str  # an ExpertBackend member, or any string for a registered backend
    sms: frozenset[int] | None  # CUDA compute capabilities it runs on; None: any
    on_cpu: str | None  # "always", "interpreter" (Triton's CPU interpreter), or None: never
    flashinfer: bool  # needs FlashInfer installed
    expert_formats: frozenset[QuantFormat] | None  # checkpoint expert formats it accepts; None: any
    all_to_all: frozenset[str | None] | None  # all-to-all backends it registers; None: any
    lora: bool
    dtypes: tuple[torch.dtype, ...]
    activations: frozenset[ActivationKind] | None  # None: every kind
    intermediate_multiple: int  # the per-partition I's multiple; padded after loading
    hidden_multiple: int  # H must be a multiple of this (H is never padded)
    fused_router: bool  # routes from the router logits inside the kernel
    runner: type  # the ExpertsRunner subclass that runs it (runners/runner.py)
    weight_formats: frozenset[Fp8Scaling | None] = frozenset({None})  # WeightFormat.fp8 values
    fp8_min_sm: int | None = None  # FP8 weights need this SM (FP8 tensor cores); None: any
    # activations of FP8 experts: bf16/fp16 for FP8 GEMMs; the dequantizing reference takes float32
    fp8_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    # dtypes correct under the CPU interpreter (its bf16 tl.dot is wrong); None: all of `dtypes`
    interpreter_dtypes: tuple[torch.dtype, ...] | None = None
    fp4: bool = False  # runs MXFP4 experts (WeightFormat.mxfp4())
    expert_bias: bool = False  # adds expert biases (ExpertWeights.w13_bias / w2_bias)
