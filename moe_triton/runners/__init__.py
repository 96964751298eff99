"""Expert backends: which one runs the experts, why, and how it runs them.

    spec.py       ExpertBackend, LayerTraits (what a layer requires), BackendSpec (what a backend runs)
    runner.py     ExpertsRunner: how a backend routes, prepares its weights and runs the experts
    flashinfer.py the FlashInfer runners (FlashInfer imported lazily) and their weight preparation
    padding.py    zero-padding I to a backend's multiple, after loading
    catalog.py    the built-in specs, the one support check, register_backend
    rules.py      per-architecture rules for backend="auto"
    resolver.py   resolve(): request + platform + model + layer -> Resolution; build_runner
"""
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
