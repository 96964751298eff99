"""Expert backends: which one runs the experts (spec, catalog, rules, resolver), why, and how
(runner, flashinfer, padding)."""
from ..context import ModelContext
from ..quant_config import ExpertsQuantization, QuantFormat, experts_quantization
from .catalog import SPECS, register_backend, unsupported_reason
from .padding import pad_experts, padded_size
from .resolver import Resolution, build_runner, resolve
from .rules import RULES, Decision, rule_for
from .runner import ExpertsRunner
from .spec import BackendSpec, ExpertBackend, LayerTraits

__all__ = [
    "SPECS", "BackendSpec", "ExpertBackend", "LayerTraits", "ModelContext", "register_backend",
    "unsupported_reason", "ExpertsRunner", "build_runner", "pad_experts", "padded_size",
    "ExpertsQuantization", "QuantFormat", "experts_quantization",
    "Resolution", "resolve", "RULES", "Decision", "rule_for",
]
