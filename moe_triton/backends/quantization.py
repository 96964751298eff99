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

Every field read is type-checked against that schema (targets a list of strings, weights a
mapping, num_bits an integer, regexes that compile, ...): a config that departs from it is
UNREADABLE with the reason, never a crash and never a guess (`"targets": "Linear"` is not read as
"no group targets the experts").
"""
from __future__ import annotations

import enum
import fnmatch
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


class Unreadable(Exception):
    """The config departs from the schema this module reads; the message says where."""


def experts_quantization(quant_config) -> ExpertsQuantization:
    """The routed experts' format under `quant_config` (a checkpoint's quantization_config, or None).
    Never raises: a config that departs from the published schema is UNREADABLE, with the reason."""
    if quant_config is None or (isinstance(quant_config, Mapping) and len(quant_config) == 0):
        return ExpertsQuantization(QuantFormat.NONE, None, "no quantization_config")
    if not isinstance(quant_config, Mapping):
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, f"quantization_config is not a mapping: {quant_config!r}")
    method = quant_config.get("quant_method")
    if method is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "quantization_config has no quant_method")
    try:
        method = _str(method, "quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(quant_config)
        if method == "modelopt":
            return _modelopt(quant_config)
    except Unreadable as error:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, f"{method} config: {error}")
    if method == "fp8":
        return ExpertsQuantization(QuantFormat.FP8, method, "quant_method 'fp8'")
    return ExpertsQuantization(QuantFormat.OTHER, method, f"quant_method {method!r}")


# ---- the schema's types: each helper returns the value or raises Unreadable ----------------------

def _str(value, where: str, optional: bool = False):
    if (value is None and optional) or isinstance(value, str):
        return value
    raise Unreadable(f"{where} must be a string, got {value!r}")


def _int(value, where: str, optional: bool = False):
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise Unreadable(f"{where} must be an integer, got {value!r}")


def _mapping(value, where: str, optional: bool = False):
    if (value is None and optional) or isinstance(value, Mapping):
        return value
    raise Unreadable(f"{where} must be a mapping, got {value!r}")


def _strings(value, where: str, optional: bool = False) -> list[str]:
    if value is None and optional:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise Unreadable(f"{where} must be a list of strings, got {value!r}")
    return value


# ---- ModelOpt -----------------------------------------------------------------------------------

def _modelopt(config: Mapping) -> ExpertsQuantization:
    nested = _mapping(config.get("quantization"), "quantization", optional=True) or {}
    algos = {_str(config.get("quant_algo"), "quant_algo", optional=True),
             _str(nested.get("quant_algo"), "quantization.quant_algo", optional=True)} - {None}
    if not algos:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "ModelOpt config without quant_algo (kept in a separate file?)")
    if len(algos) > 1:
        raise Unreadable(f"quant_algo and quantization.quant_algo disagree: {sorted(algos)}")
    (algo,) = algos
    for source, where in ((config, ""), (nested, "quantization.")):
        for key in ("exclude_modules", "ignore"):
            excluded = _strings(source.get(key), f"{where}{key}", optional=True)
            if any(fnmatch.fnmatchcase(module, pattern) for pattern in excluded for module in EXPERT_MODULE_NAMES):
                raise Unreadable(f"{where}{key} excludes expert modules from {algo!r}; per-module formats are not read")
    if algo.upper() == "NVFP4":
        return ExpertsQuantization(QuantFormat.NVFP4, "modelopt", "ModelOpt quant_algo 'NVFP4'")
    if algo.upper().startswith("FP8"):
        return ExpertsQuantization(QuantFormat.FP8, "modelopt", f"ModelOpt quant_algo {algo!r}")
    if algo.upper() == "MIXED_PRECISION":  # the per-layer map lives in a separate file
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "ModelOpt MIXED_PRECISION (per-layer map not read)")
    return ExpertsQuantization(QuantFormat.OTHER, "modelopt", f"ModelOpt quant_algo {algo!r}")


# ---- compressed-tensors ------------------------------------------------------------------------

def _compressed_tensors(config: Mapping) -> ExpertsQuantization:
    groups = config.get("config_groups")
    if groups is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, "compressed-tensors config without config_groups")
    groups = {name: _group(group, f"config_groups.{name}") for name, group in _mapping(groups, "config_groups").items()}
    default_format = _str(config.get("format"), "format", optional=True)
    ignore = [_pattern(p, "ignore") for p in _strings(config.get("ignore"), "ignore", optional=True)]
    decided: dict[QuantFormat, set[str]] = {}
    for module in EXPERT_MODULE_NAMES:
        if any(_matches(pattern, module) for pattern in ignore):
            continue
        for name in _groups_for(module, groups):
            fmt = _group_format(groups[name], default_format)
            decided.setdefault(fmt, set()).add(name)
    if not decided:
        return ExpertsQuantization(QuantFormat.NONE, None, "no compressed-tensors group targets the experts")
    if len(decided) > 1:
        found = ", ".join(f"{fmt.value} from {sorted(names)}" for fmt, names in decided.items())
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   f"compressed-tensors groups disagree on the experts: {found}")
    (fmt, names), = decided.items()
    return ExpertsQuantization(fmt, "compressed-tensors", f"compressed-tensors group(s) {sorted(names)} target the experts")


def _group(group, where: str) -> dict:
    """A config group's fields this module reads, type-checked; weights with the schema's defaults."""
    group = _mapping(group, where)
    weights = _mapping(group.get("weights"), f"{where}.weights", optional=True)
    if weights is not None:  # QuantizationArgs defaults: 8-bit int
        weights = dict(num_bits=_int(weights.get("num_bits", 8), f"{where}.weights.num_bits"),
                       type=_str(weights.get("type", "int"), f"{where}.weights.type"),
                       group_size=_int(weights.get("group_size"), f"{where}.weights.group_size", optional=True))
    return dict(targets=[_pattern(t, f"{where}.targets") for t in _strings(group.get("targets"), f"{where}.targets")],
                format=_str(group.get("format"), f"{where}.format", optional=True), weights=weights)


def _pattern(pattern: str, where: str) -> str:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as error:
            raise Unreadable(f"{where} holds an invalid regex {pattern!r}: {error}") from None
    return pattern


def _groups_for(module: str, groups: Mapping) -> list[str]:
    # compressed-tensors precedence: a name or regex target beats a class-name target ("Linear").
    named = [name for name, group in groups.items()
             if any(_matches(t, module) for t in group["targets"] if t.startswith("re:") or "." in t)]
    return named or [name for name, group in groups.items() if "Linear" in group["targets"]]


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _group_format(group: dict, default_format: str | None) -> QuantFormat:
    fmt = group["format"] or default_format
    if fmt in _COMPRESSED_FORMATS:
        return _COMPRESSED_FORMATS[fmt]
    weights = group["weights"]
    if weights is None:
        return QuantFormat.OTHER
    if weights["type"] == "float" and weights["num_bits"] == 4 and weights["group_size"] == 16:
        return QuantFormat.NVFP4
    if weights["type"] == "float" and weights["num_bits"] == 8:
        return QuantFormat.FP8
    return QuantFormat.OTHER
