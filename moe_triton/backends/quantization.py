"""How a checkpoint's routed experts are quantized, read from its `quantization_config`.

Backend rules must decide on the *experts'* format, not on any quantized module: a checkpoint
with NVFP4 attention and FP8 experts has FP8 experts. Anything this module cannot read with
certainty is `UNREADABLE`, and every rule treats that as "keep the default" (fail closed).

Shapes read (as real checkpoints write them):
- compressed-tensors: `{"quant_method": "compressed-tensors", "format": ..., "config_groups":
  {name: {"targets": [...], "format": ..., "weights": {...}}}, "ignore": [...]}`; targets are
  module class names ("Linear") or regexes ("re:.*experts.*").
- ModelOpt: `{"quant_method": "modelopt", "quant_algo": "NVFP4" | "FP8" | ...}`, the algorithm
  either at the top or under "quantization" (the hf_quant_config.json shape).
- any other method ("fp8", "awq", ...) by name; a non-mapping, or ModelOpt without an algorithm
  (the config lives in a separate file we do not read), is unreadable.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass


class QuantFormat(enum.Enum):
    NONE = "unquantized"
    NVFP4 = "NVFP4"
    FP8 = "FP8"
    OTHER = "other"  # readable, but a format no backend rule pins (int4, mxfp4, ...)
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class ExpertsQuantization:
    format: QuantFormat
    method: str | None  # "compressed-tensors", "modelopt", ... ; None when unquantized or unreadable
    detail: str  # what in the config decided it, for the resolution's reason

    def __str__(self) -> str:
        return f"{self.format.value} experts ({self.detail})"


# Representative expert weight names of the families we serve; a target that matches one of
# them targets the routed experts.
EXPERT_MODULE_NAMES = (
    "model.layers.0.mlp.experts.0.gate_proj",
    "model.layers.0.mlp.experts.0.up_proj",
    "model.layers.0.mlp.experts.0.down_proj",
    "model.language_model.layers.0.mlp.experts.0.gate_proj",
    "model.language_model.layers.0.mlp.experts.0.down_proj",
    "model.layers.0.block_sparse_moe.experts.0.w1",
    "model.layers.0.block_sparse_moe.experts.0.w2",
    "model.layers.0.block_sparse_moe.experts.0.w3",
)
_COMPRESSED_FORMATS = {"nvfp4-pack-quantized": QuantFormat.NVFP4, "float-quantized": QuantFormat.FP8}


def experts_quantization(quant_config) -> ExpertsQuantization:
    """The routed experts' format under `quant_config` (a checkpoint's quantization_config, or None)."""
    if quant_config is None or quant_config == {}:
        return ExpertsQuantization(QuantFormat.NONE, None, "no quantization_config")
    if not isinstance(quant_config, Mapping):
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, f"quantization_config is not a mapping: {quant_config!r}")
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant_config)
    if method == "modelopt":
        return _modelopt(quant_config)
    if method == "fp8":
        return ExpertsQuantization(QuantFormat.FP8, method, "quant_method 'fp8'")
    if method is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "quantization_config has no quant_method")
    return ExpertsQuantization(QuantFormat.OTHER, method, f"quant_method {method!r}")


def _modelopt(config: Mapping) -> ExpertsQuantization:
    algo = config.get("quant_algo") or (config.get("quantization") or {}).get("quant_algo")
    if not isinstance(algo, str):
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "ModelOpt config without quant_algo (kept in a separate file?)")
    if algo.upper() == "NVFP4":
        return ExpertsQuantization(QuantFormat.NVFP4, "modelopt", "ModelOpt quant_algo 'NVFP4'")
    if algo.upper().startswith("FP8"):
        return ExpertsQuantization(QuantFormat.FP8, "modelopt", f"ModelOpt quant_algo {algo!r}")
    if algo.upper() == "MIXED_PRECISION":  # the per-layer map lives in a separate file
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "ModelOpt MIXED_PRECISION (per-layer map not read)")
    return ExpertsQuantization(QuantFormat.OTHER, "modelopt", f"ModelOpt quant_algo {algo!r}")


def _compressed_tensors(config: Mapping) -> ExpertsQuantization:
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping):
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "compressed-tensors config without config_groups")
    ignore = config.get("ignore") or []
    decided: dict[QuantFormat, set[str]] = {}
    for module in EXPERT_MODULE_NAMES:
        if any(_matches(pattern, module) for pattern in ignore):
            continue
        for name in _groups_for(module, groups):
            fmt = _group_format(groups[name], config.get("format"))
            decided.setdefault(fmt, set()).add(name)
    if not decided:
        return ExpertsQuantization(QuantFormat.NONE, None, "no compressed-tensors group targets the experts")
    if len(decided) > 1:
        found = ", ".join(f"{fmt.value} from {sorted(names)}" for fmt, names in decided.items())
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   f"compressed-tensors groups disagree on the experts: {found}")
    (fmt, names), = decided.items()
    return ExpertsQuantization(fmt, "compressed-tensors", f"compressed-tensors group(s) {sorted(names)} target the experts")


def _groups_for(module: str, groups: Mapping) -> list[str]:
    # compressed-tensors precedence: a name or regex target beats a class-name target ("Linear").
    named = [name for name, group in groups.items()
             if any(_matches(t, module) for t in _targets(group) if t.startswith("re:") or "." in t)]
    return named or [name for name, group in groups.items() if "Linear" in _targets(group)]


def _targets(group) -> list[str]:
    return list(group.get("targets") or []) if isinstance(group, Mapping) else []


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _group_format(group, default_format) -> QuantFormat:
    fmt = (group.get("format") or default_format) if isinstance(group, Mapping) else None
    if fmt in _COMPRESSED_FORMATS:
        return _COMPRESSED_FORMATS[fmt]
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        return QuantFormat.OTHER
    if weights.get("type") == "float" and weights.get("num_bits") == 4 and weights.get("group_size") == 16:
        return QuantFormat.NVFP4
    if weights.get("type") == "float" and weights.get("num_bits") == 8:
        return QuantFormat.FP8
    return QuantFormat.OTHER
