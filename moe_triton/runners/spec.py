"""The backends as data: their names, what a layer requires of one (`LayerTraits`), and what
each can run (`BackendSpec`). The table of specs is catalog.py's; nothing here imports a runner.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..activation import Activation, ActivationKind
from ..quant_config import QuantFormat
from ..routing import RoutingSpec
from ..weights import NATIVE, Fp8Scaling, WeightFormat


class ExpertBackend(str, enum.Enum):
    """The built-in backends; a member equals its name string, so registered backends sit beside them."""

    TRITON = "triton"  # our pipeline (routing, expand, GEMMs, activation, finalize)
    TORCH = "torch"  # the float32 reference, cast back to the input dtype
    FLASHINFER_TRTLLM = "flashinfer_trtllm"  # trtllm-gen: routing from logits + experts, one fused path
    FLASHINFER_TRTLLM_ROUTED = "flashinfer_trtllm_routed"  # trtllm-gen on our precomputed top-k
    FLASHINFER_CUTLASS = "flashinfer_cutlass"  # FlashInfer's CUTLASS fused MoE on our top-k

    def __str__(self) -> str:
        return self.value


# The expert-parallel all-to-all backends serving engines name (vLLM's --all2all-backend, SGLang's
# --moe-a2a-backend): the values `moe-triton resolve --all-to-all` accepts.
ALL_TO_ALL_BACKENDS = ("naive", "allgather_reducescatter", "pplx", "deepep", "deepep_high_throughput",
                       "deepep_low_latency", "flashinfer_all2allv", "mooncake")


@dataclass(frozen=True)
class LayerTraits:
    """What the layer itself requires of a backend (and what its runner is built with)."""

    hidden_size: int  # the experts' H
    dtype: torch.dtype  # the activations' dtype (the weights' too, unless `format` quantizes them)
    activation: Activation
    routing: RoutingSpec
    format: WeightFormat = NATIVE  # how the expert weights are stored


@dataclass(frozen=True)
class BackendSpec:
    backend: str  # its name: an ExpertBackend member, or any string for a registered backend
    sms: frozenset[int] | None  # CUDA compute capabilities it runs on; None: any
    on_cpu: str | None  # "always", "interpreter" (Triton's CPU interpreter), or None: never
    flashinfer: bool  # needs FlashInfer installed
    expert_formats: frozenset[QuantFormat] | None  # checkpoint expert formats it accepts; None: any
    all_to_all: frozenset[str | None] | None  # all-to-all backends it has a registration for; None: any
    lora: bool
    dtypes: tuple[torch.dtype, ...]
    activations: frozenset[ActivationKind] | None  # None: every kind
    intermediate_multiple: int  # the per-partition I must be a multiple of this; padded after loading
    hidden_multiple: int  # H must be a multiple of this (H is never padded)
    fused_router: bool  # routes from the router logits inside the kernel
    runner: type  # the ExpertsRunner subclass that runs it (runners/runner.py)
    weight_formats: frozenset[Fp8Scaling | None] = frozenset({None})  # WeightFormat.fp8 values it runs (None: unquantized)
    fp8_min_sm: int | None = None  # FP8 weights need this compute capability (FP8 tensor cores); None: any
    # The activation dtypes it runs FP8 experts with: bf16/fp16 for FP8 GEMMs; the torch reference,
    # which dequantizes, takes float32 too (a float32 model of an FP8 checkpoint on CPU).
    fp8_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    # The dtypes it computes correctly on CPU under the Triton interpreter (on_cpu="interpreter");
    # None: all of `dtypes`. A per-platform dtype rule: the interpreter's bf16 tl.dot is wrong.
    interpreter_dtypes: tuple[torch.dtype, ...] | None = None
