"""Per-architecture rules for `backend="auto"`: one family, platform and quantization each, a pin
or the default with why; the resolver still checks a pin. There is no global fallback."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..context import ModelContext
from ..platform import Platform
from ..quant_config import QuantFormat
from .spec import ExpertBackend


@dataclass(frozen=True)
class Decision:
    backend: ExpertBackend | None  # None: keep the default
    reason: str


@dataclass(frozen=True)
class Rule:
    name: str
    architectures: tuple[str, ...]
    decide: Callable[[Platform, ModelContext], Decision]


RULES: dict[str, Rule] = {}
_BLACKWELL = (100, 103)  # where trtllm-gen runs


def rule(*architectures: str):
    def register(decide):
        for name in architectures:
            if name in RULES:
                raise ValueError(f"architecture {name!r} already has rule {RULES[name].name}")
            RULES[name] = Rule(decide.__name__, architectures, decide)
        return decide
    return register


def rule_for(architecture: str | None) -> Rule | None:
    return RULES.get(architecture) if architecture else None


@rule("Cohere2MoeForCausalLM", "Cohere2VisionForConditionalGeneration")
def cohere2_moe(platform: Platform, context: ModelContext) -> Decision:
    if platform.sm not in _BLACKWELL:
        return Decision(None, "the fused trtllm-gen path is pinned on SM100/SM103 only, "
                              f"not {platform}")
    quant = context.quantization.experts
    if quant.format in (QuantFormat.NONE, QuantFormat.NVFP4):
        return Decision(ExpertBackend.FLASHINFER_TRTLLM,
                        f"{quant} on {platform}: trtllm-gen fuses routing and experts")
    if quant.format is QuantFormat.FP8:
        return Decision(None, f"{quant}: the fused path rejects this FP8 MoE format "
                              "at the first forward")
    return Decision(None, f"{quant}: not a format the fused path is known to take; fail closed")


@rule("MiniMaxM2ForCausalLM")
def minimax_m2(platform: Platform, context: ModelContext) -> Decision:
    if platform.sm not in _BLACKWELL:
        return Decision(None, "the routed trtllm-gen path is pinned on SM100/SM103 only, "
                              f"not {platform}")
    quant = context.quantization.experts
    if quant.format is QuantFormat.NVFP4 and quant.method == "modelopt":
        return Decision(ExpertBackend.FLASHINFER_TRTLLM_ROUTED,
                        f"{quant} on {platform}: "
                        "trtllm-gen on our sigmoid + correction-bias top-k, "
                        "which its fused router does not compute")
    return Decision(None, f"{quant}: only ModelOpt NVFP4 is pinned")
