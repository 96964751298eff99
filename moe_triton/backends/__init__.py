"""Expert backends: which one runs the experts, why, and what it needs.

    catalog.py       ExpertBackend, each backend's BackendSpec (and runner), the one support check, register_backend
    quantization.py  a checkpoint's quantization_config -> the experts' format
    rules.py         per-architecture rules for backend="auto"
    resolver.py      resolve(): request + platform + model + layer -> Resolution (backend, rule, reason)
    padding.py       zero-padding I to a backend's multiple, after loading
    runners.py       ExpertsRunner: how a backend routes, prepares its weights and runs the experts
    flashinfer.py    the FlashInfer runners (FlashInfer imported lazily) and their weight preparation
"""
from .catalog import SPECS, BackendSpec, ExpertBackend, LayerTraits, ModelContext, register_backend, unsupported_reason
from .padding import pad_experts, padded_size
from .quantization import ExpertsQuantization, QuantFormat, experts_quantization
from .resolver import Resolution, resolve
from .rules import RULES, Decision, rule_for
from .runners import ExpertsRunner

__all__ = [
    "SPECS", "BackendSpec", "ExpertBackend", "LayerTraits", "ModelContext", "register_backend", "unsupported_reason",
    "ExpertsRunner",
    "pad_experts", "padded_size", "ExpertsQuantization", "QuantFormat", "experts_quantization",
    "Resolution", "resolve", "RULES", "Decision", "rule_for",
]
