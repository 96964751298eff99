"""The resolver: one pure function from a request and what is known to the backend, and why.
An explicit request runs unchanged or is a ValueError; "auto" takes the architecture rule's pin
when it runs here, else the default (triton on GPU or in the interpreter's exact dtypes; torch)."""
from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

from ..context import ModelContext
from ..placement import Placement
from ..platform import Platform, interpreter_hint
from .catalog import SPECS, unsupported_reason
from .rules import rule_for
from .runner import ExpertsRunner, ParallelRunner
from .spec import ExpertBackend, LayerTraits

logger = logging.getLogger("moe_triton")

AUTO = "auto"
EXPLICIT = "explicit request"
DEFAULT = "default"


@dataclass(frozen=True)
class Resolution:
    backend: str  # a backend's name (an ExpertBackend member for the built-in ones)
    requested: str  # "auto" or a backend's value
    rule: str  # EXPLICIT, DEFAULT, or the name of the architecture rule that decided
    reason: str
    platform: Platform

    def __str__(self) -> str:
        return (f"{self.backend} (requested {self.requested}, {self.platform}, rule: {self.rule}): "
                f"{self.reason}")

    @property
    def torch_fallback(self) -> bool:
        """auto chose the torch reference: the Triton kernels do not run here."""
        return self.requested == AUTO and self.backend == ExpertBackend.TORCH


def parse_backend(backend: str) -> str:
    """AUTO or a registered backend's name; a ValueError listing the choices otherwise."""
    if backend == AUTO:
        return AUTO
    if isinstance(backend, str) and backend in SPECS:
        return SPECS[backend].backend  # the ExpertBackend member for a built-in name
    choices = ", ".join([AUTO, *map(str, SPECS)])
    raise ValueError(f"backend={backend!r} is not a backend; pass one of {choices}")


def default_candidates(platform: Platform,
                       layer: LayerTraits | None = None) -> list[tuple[ExpertBackend, str]]:
    """The defaults for this platform and layer, best first, each with why."""
    if platform.device_type == "cuda":
        return [(ExpertBackend.TRITON,
                 "no rule pins another backend: the Triton pipeline on a CUDA GPU")]
    if layer is not None and layer.format.quantized:
        return [(ExpertBackend.TORCH,
                 f"CPU with {layer.format} experts: the float32 torch reference, dequantized")]
    if platform.interpreter:
        return [(ExpertBackend.TRITON,
                 "CPU with the Triton interpreter on: the Triton pipeline, interpreted"),
                (ExpertBackend.TORCH, "the torch reference")]
    return [(ExpertBackend.TORCH, "CPU without the Triton interpreter: the torch reference "
                                  f"({interpreter_hint()} to run the Triton kernels)")]


def default_backend(platform: Platform, context: ModelContext = ModelContext(),
                    layer: LayerTraits | None = None) -> tuple[ExpertBackend, str]:
    """The first candidate that runs the layer correctly; else a ValueError naming every reason."""
    reasons = []
    for backend, why in default_candidates(platform, layer):
        blocked = unsupported_reason(backend, platform, context, layer)
        if blocked is None:
            return backend, why + (f", as {'; '.join(reasons)}" if reasons else "")
        reasons.append(f"{backend} cannot run here: {blocked}")
    raise ValueError(f"no backend can run this layer on {platform}: {'; '.join(reasons)}")


def resolve(requested: str, platform: Platform, context: ModelContext = ModelContext(),
            layer: LayerTraits | None = None) -> Resolution:
    """A ValueError for an explicit request that cannot run here."""
    requested = parse_backend(requested)
    if requested != AUTO:
        reason = unsupported_reason(requested, platform, context, layer)
        if reason:
            raise ValueError(f"backend={str(requested)!r} cannot run on {platform}: {reason}. "
                             f"Choose another backend, or backend='auto'")
        return Resolution(requested, str(requested), EXPLICIT,
                          "requested explicitly, never rewritten", platform)
    default, why_default = default_backend(platform, context, layer)
    rule = rule_for(context.architecture)
    if rule is None:
        return Resolution(default, AUTO, DEFAULT,
                          f"no rule for {context.architecture or 'this model'}; {why_default}",
                          platform)
    decision = rule.decide(platform, context)
    if decision.backend is None:
        return Resolution(default, AUTO, rule.name, f"{decision.reason}; keeps {default}", platform)
    blocked = unsupported_reason(decision.backend, platform, context, layer)
    if blocked:
        return Resolution(default, AUTO, rule.name,
                          f"would pick {decision.backend} ({decision.reason}), "
                          f"but {blocked}; keeps {default}", platform)
    return Resolution(decision.backend, AUTO, rule.name, decision.reason, platform)


@functools.cache
def _log_resolution(resolution: Resolution) -> None:
    # once per distinct resolution per process, not once per layer of a 60-layer model
    logger.info("moe_triton experts backend: %s", resolution)


@functools.cache
def warn_fallback(reason: str) -> None:
    # said where users look: a warning, once per process and reason
    warnings.warn("moe_triton: the experts run on the torch reference backend, "
                  f"not the Triton kernels: {reason}", stacklevel=2)


def build_runner(resolution: Resolution, layer: LayerTraits, placement: Placement) -> ExpertsRunner:
    """The resolved backend's runner, inside the parallel dispatch when the experts are sharded."""
    _log_resolution(resolution)
    if resolution.torch_fallback:
        warn_fallback(resolution.reason)
    spec = SPECS[resolution.backend]
    runner = spec.runner(spec, layer, placement.resolution_context())
    if placement.parallel is None:
        return runner
    return ParallelRunner(runner, placement.parallel)
