"""How a checkpoint's routed experts are quantized (NVFP4 attention, FP8 experts: FP8). Every
field is type-checked against the published schema: anything else is `UNREADABLE` with the
reason, never a crash or a guess, and rules keep the default on it (fail closed)."""
from __future__ import annotations

import enum
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .weights import NATIVE, WeightFormat


class QuantFormat(enum.Enum):
    NONE = "unquantized"
    NVFP4 = "NVFP4"
    FP8 = "FP8"
    MXFP4 = "MXFP4"  # gpt-oss's experts (quant_method "mxfp4")
    OTHER = "other"  # readable, but a format no backend rule pins (int4, ...)
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class ExpertsQuantization:
    format: QuantFormat
    method: str | None  # "compressed-tensors", "modelopt", ...; None: unquantized or unreadable
    detail: str  # what in the config decided it, for the resolution's reason

    def __str__(self) -> str:
        return f"{self.format.value} experts ({self.detail})"


# Expert weight names of the families we serve: a target matching one targets the routed experts.
EXPERT_MODULE_NAMES = (
    "model.layers.0.mlp.experts.0.gate_proj",
    "model.layers.0.mlp.experts.0.up_proj",
    "model.layers.0.mlp.experts.0.down_proj",
    "model.language_model.layers.0.mlp.experts.0.gate_proj",
    "model.language_model.layers.0.mlp.experts.0.down_proj",
    "model.layers.0.block_sparse_moe.experts.0.w1",
    "model.layers.0.block_sparse_moe.experts.0.w2",
    "model.layers.0.block_sparse_moe.experts.0.w3",
    "model.layers.0.mlp.experts.gate_up_proj",  # fused experts (gpt-oss)
    "model.layers.0.mlp.experts.down_proj",
)
_COMPRESSED_FORMATS = {"nvfp4-pack-quantized": QuantFormat.NVFP4,
                       "float-quantized": QuantFormat.FP8}


class Unreadable(Exception):
    """The config departs from the schema read here; the message says where."""


def experts_quantization(quant_config) -> ExpertsQuantization:
    """Never raises: a config that departs from the schema is UNREADABLE, with the reason."""
    if quant_config is None or (isinstance(quant_config, Mapping) and len(quant_config) == 0):
        return ExpertsQuantization(QuantFormat.NONE, None, "no quantization_config")
    if not isinstance(quant_config, Mapping):
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   f"quantization_config is not a mapping: {quant_config!r}")
    method = quant_config.get("quant_method")
    if method is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "quantization_config has no quant_method")
    try:
        method = _str(method, "quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(quant_config)
        if method == "modelopt":
            return _modelopt(quant_config)
        if method == "fp8":
            if _fp8_excludes_experts(quant_config):
                return ExpertsQuantization(QuantFormat.NONE, None,
                                           "quant_method 'fp8', experts in modules_to_not_convert")
            return ExpertsQuantization(QuantFormat.FP8, method, "quant_method 'fp8'")
        if method == "mxfp4":
            if _fp8_excludes_experts(quant_config):
                return ExpertsQuantization(QuantFormat.NONE, None, "quant_method 'mxfp4', "
                                           "experts in modules_to_not_convert")
            return ExpertsQuantization(QuantFormat.MXFP4, method, "quant_method 'mxfp4'")
    except Unreadable as error:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None, f"{method} config: {error}")
    return ExpertsQuantization(QuantFormat.OTHER, method, f"quant_method {method!r}")


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


def _modelopt(config: Mapping) -> ExpertsQuantization:
    algo = _modelopt_algo(config)
    if algo is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "ModelOpt config without quant_algo (kept in a separate file?)")
    if algo.upper() == "NVFP4":
        return ExpertsQuantization(QuantFormat.NVFP4, "modelopt", "ModelOpt quant_algo 'NVFP4'")
    if algo.upper().startswith("FP8"):
        return ExpertsQuantization(QuantFormat.FP8, "modelopt", f"ModelOpt quant_algo {algo!r}")
    if algo.upper() == "MIXED_PRECISION":  # the per-layer map lives in a separate file
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "ModelOpt MIXED_PRECISION (per-layer map not read)")
    return ExpertsQuantization(QuantFormat.OTHER, "modelopt", f"ModelOpt quant_algo {algo!r}")


def _modelopt_algo(config: Mapping) -> str | None:
    """quant_algo (top-level or under "quantization"); Unreadable if they differ or skip experts."""
    nested = _mapping(config.get("quantization"), "quantization", optional=True) or {}
    algos = {_str(config.get("quant_algo"), "quant_algo", optional=True),
             _str(nested.get("quant_algo"), "quantization.quant_algo", optional=True)} - {None}
    if len(algos) > 1:
        raise Unreadable(f"quant_algo and quantization.quant_algo disagree: {sorted(algos)}")
    algo = next(iter(algos), None)
    for source, where in ((config, ""), (nested, "quantization.")):
        for key in ("exclude_modules", "ignore"):
            excluded = _strings(source.get(key), f"{where}{key}", optional=True)
            if any(fnmatch.fnmatchcase(module, pattern)
                   for pattern in excluded for module in EXPERT_MODULE_NAMES):
                raise Unreadable(f"{where}{key} excludes expert modules from {algo!r}; "
                                 "per-module formats are not read")
    return algo


def _compressed_tensors(config: Mapping) -> ExpertsQuantization:
    groups = config.get("config_groups")
    if groups is None:
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   "compressed-tensors config without config_groups")
    groups = {name: _group(group, f"config_groups.{name}")
              for name, group in _mapping(groups, "config_groups").items()}
    default_format = _str(config.get("format"), "format", optional=True)
    ignore = [_pattern(p, "ignore")
              for p in _strings(config.get("ignore"), "ignore", optional=True)]
    decided: dict[QuantFormat, set[str]] = {}
    for module in EXPERT_MODULE_NAMES:
        if any(_matches(pattern, module) for pattern in ignore):
            continue
        for name in _groups_for(module, groups):
            fmt = _group_format(groups[name], default_format)
            decided.setdefault(fmt, set()).add(name)
    if not decided:
        return ExpertsQuantization(QuantFormat.NONE, None,
                                   "no compressed-tensors group targets the experts")
    if len(decided) > 1:
        found = ", ".join(f"{fmt.value} from {sorted(names)}" for fmt, names in decided.items())
        return ExpertsQuantization(QuantFormat.UNREADABLE, None,
                                   f"compressed-tensors groups disagree on the experts: {found}")
    (fmt, names), = decided.items()
    return ExpertsQuantization(fmt, "compressed-tensors",
                               f"compressed-tensors group(s) {sorted(names)} target the experts")


def _group(group, where: str) -> dict:
    group = _mapping(group, where)
    weights = _mapping(group.get("weights"), f"{where}.weights", optional=True)
    if weights is not None:  # QuantizationArgs defaults: 8-bit int
        weights = dict(num_bits=_int(weights.get("num_bits", 8), f"{where}.weights.num_bits"),
                       type=_str(weights.get("type", "int"), f"{where}.weights.type"),
                       group_size=_int(weights.get("group_size"), f"{where}.weights.group_size",
                                       optional=True))
    return dict(targets=[_pattern(t, f"{where}.targets")
                         for t in _strings(group.get("targets"), f"{where}.targets")],
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
             if any(_matches(t, module) for t in group["targets"]
                    if t.startswith("re:") or "." in t)]
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


def _fp8_excludes_experts(config: Mapping) -> bool:
    """`modules_to_not_convert` (MiniMax: `ignored_layers`) matched as transformers does: a regex
    from the start up to a module boundary, or a suffix."""
    key = ("modules_to_not_convert" if config.get("modules_to_not_convert") is not None
           else "ignored_layers")
    patterns = _strings(config.get(key), key, optional=True)
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:
        try:
            regex = re.compile(rf"(?:{pattern}){boundary}")
        except re.error as error:
            raise Unreadable(f"{key} holds an invalid regex {pattern!r}: {error}") from None
        if any(regex.match(module) or module.endswith(pattern)
               for module in EXPERT_MODULE_NAMES):
            return True
    return False


@dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint stores its quantized weights; every FP8 scale multiplies
    (`weight_scale_inv` too)."""

    method: str | None = None  # "fp8", "compressed-tensors", "modelopt", "mxfp4"; None: unquantized
    experts: WeightFormat = NATIVE  # the routed experts' format: what FusedMoE holds them in
    weight_scale: str = "weight_scale"  # `<module>.weight`'s scale is `<module>.<weight_scale>`
    linear_blocks: tuple[tuple[int, int], ...] = ()  # (block_n, block_k) of block-scaled linears

    def __str__(self) -> str:
        return "unquantized" if self.method is None else f"{self.method}: experts {self.experts}"


_FP8_METHODS = ("'fp8' (weight_block_size), 'compressed-tensors' (FP8 config_groups), "
                "'modelopt' (quant_algo FP8) or 'mxfp4' (gpt-oss's experts)")


def checkpoint_format(quant_config) -> CheckpointFormat:
    """A ValueError names the key and what was expected when the FP8 kernels cannot run it."""
    if quant_config is None or (isinstance(quant_config, Mapping) and len(quant_config) == 0):
        return CheckpointFormat()
    if not isinstance(quant_config, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {quant_config!r}")
    method = quant_config.get("quant_method")
    try:
        if method == "fp8":
            return _fp8_checkpoint(quant_config)
        if method == "compressed-tensors":
            return _compressed_tensors_checkpoint(quant_config)
        if method == "modelopt":
            return _modelopt_checkpoint(quant_config)
        if method == "mxfp4":  # only the experts: attention, router, embeddings stay bf16
            experts = NATIVE if _fp8_excludes_experts(quant_config) else WeightFormat.mxfp4()
            return CheckpointFormat("mxfp4", experts)
    except Unreadable as error:
        raise ValueError(f"quantization_config: {error}") from None
    raise ValueError(f"quantization_config.quant_method={method!r}: expected {_FP8_METHODS}")


def config_group_formats(quant_config) -> list[tuple[str, str]]:
    """(config group, the format it gives its modules), for `moe-triton resolve`. Never raises."""
    if not isinstance(quant_config, Mapping) or not quant_config:
        return []
    groups = quant_config.get("config_groups")
    if quant_config.get("quant_method") != "compressed-tensors" or not isinstance(groups, Mapping):
        return [("quantization_config",
                 _described(lambda: str(checkpoint_format(quant_config).experts)))]
    default = quant_config.get("format")
    return [(f"config_groups.{name}",
             _described(lambda name=name, group=group: f"targets {group.get('targets')}: "
                                f"{_ct_group_format(name, group, default)}"))
            for name, group in groups.items()]


def _described(describe) -> str:
    try:
        return describe()
    except (ValueError, Unreadable, AttributeError, TypeError) as error:
        return f"not run here: {error}"


def _fp8_checkpoint(config: Mapping) -> CheckpointFormat:
    # transformers' FineGrainedFP8Config fields and MiniMax-M2's config.json
    for key, accepted in (("fmt", ("float8_e4m3fn", "e4m3")), ("scale_fmt", ("float",)),
                          ("expert_dtype", ("fp8",)), ("activation_scheme", ("dynamic",))):
        if config.get(key, accepted[0]) not in accepted:
            raise ValueError(f"quantization_config.{key}={config[key]!r}: "
                             f"expected {' or '.join(map(repr, accepted))} (e4m3 weights, "
                             "float32 block scales, dynamic per-token-group activations)")
    if config.get("weight_block_size") is None:
        raise ValueError("quantization_config.weight_block_size is missing: "
                         "expected [block_n, block_k] (per-tensor 'fp8' checkpoints are not read)")
    block = _block_format(config["weight_block_size"], "weight_block_size")
    experts = NATIVE if _fp8_excludes_experts(config) else block
    return CheckpointFormat("fp8", experts, "weight_scale_inv", (block.block,))


def _block_format(value, key: str) -> WeightFormat:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
        try:
            return WeightFormat.fp8_block(*value)
        except ValueError:
            pass
    raise ValueError(f"quantization_config.{key}={value!r}: expected [block_n, block_k], "
                     "block_n >= 1 and block_k a power of two >= 16 "
                     "(128 x 128 in every public checkpoint)")


def _modelopt_checkpoint(config: Mapping) -> CheckpointFormat:
    # as vLLM reads them: "FP8" is a per-tensor weight_scale with a static per-tensor input_scale
    algo = _modelopt_algo(config)
    formats = {"FP8": WeightFormat.fp8_tensor(static_input=True),
               "FP8_PER_CHANNEL_PER_TOKEN": WeightFormat.fp8_channel()}
    if algo is None or algo.upper() not in formats:
        raise ValueError(f"quantization_config.quant_algo={algo!r}: expected 'FP8' or "
                         "'FP8_PER_CHANNEL_PER_TOKEN' (ModelOpt's per-tensor and per-channel FP8)")
    return CheckpointFormat("modelopt", formats[algo.upper()], "weight_scale")


def _compressed_tensors_checkpoint(config: Mapping) -> CheckpointFormat:
    raw = _mapping(config.get("config_groups"), "config_groups")
    groups = {name: _group(group, f"config_groups.{name}") for name, group in raw.items()}
    ignore = [_pattern(p, "ignore")
              for p in _strings(config.get("ignore"), "ignore", optional=True)]
    default = _str(config.get("format"), "format", optional=True)
    names = sorted({name for module in EXPERT_MODULE_NAMES
                    if not any(_matches(p, module) for p in ignore)
                    for name in _groups_for(module, groups)})
    formats = {name: _ct_group_format(name, raw[name], default) for name in names}
    if len(set(formats.values())) > 1:
        raise ValueError(f"quantization_config.config_groups {names} give the experts "
                         "different formats: "
                         f"{ {name: str(fmt) for name, fmt in formats.items()} }")
    blocks = tuple(sorted({_ct_block(name, group) for name, group in raw.items()} - {None}))
    return CheckpointFormat("compressed-tensors", formats[names[0]] if names else NATIVE,
                            "weight_scale", blocks)


def _ct_group_format(name: str, group: Mapping, default_format: str | None) -> WeightFormat:
    """Its FP8 format, per compressed-tensors' QuantizationArgs (FP8, FP8_DYNAMIC, FP8_BLOCK)."""
    where = f"quantization_config.config_groups.{name}"
    weights = group.get("weights")
    if (not isinstance(weights, Mapping)
            or (weights.get("num_bits", 8), weights.get("type", "int")) != (8, "float")):
        raise ValueError(f"{where}.weights={weights!r}: "
                         "expected FP8 weights (num_bits 8, type 'float')")
    fmt = group.get("format") or default_format
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"{where}.format={fmt!r}: "
                         "expected 'float-quantized' (FP8 weights stored as they are)")
    if weights.get("dynamic", False) is not False:
        raise ValueError(f"{where}.weights.dynamic={weights['dynamic']!r}: "
                         "expected false (calibrated weight scales)")
    strategy = weights.get("strategy") or "tensor"
    static_input = _ct_static_input(where, group.get("input_activations"))
    if strategy == "tensor":
        return WeightFormat.fp8_tensor(static_input=static_input)
    if strategy not in ("channel", "block"):
        raise ValueError(f"{where}.weights.strategy={strategy!r}: "
                         "expected 'tensor', 'channel' or 'block'")
    if static_input:
        raise ValueError(f"{where}.input_activations: static activation scales with strategy "
                         f"{strategy!r} weights: expected dynamic activations "
                         "(static ones go with strategy 'tensor' weights)")
    if strategy == "channel":
        return WeightFormat.fp8_channel()
    return _block_format(weights.get("block_structure"),
                         f"config_groups.{name}.weights.block_structure")


def _ct_static_input(where: str, inputs) -> bool:
    if inputs is None:
        raise ValueError(f"{where}.input_activations is missing: expected FP8 activations "
                         "(dynamic, or static per tensor); weight-only FP8 is not run")
    if (not isinstance(inputs, Mapping)
            or (inputs.get("num_bits", 8), inputs.get("type", "int")) != (8, "float")):
        raise ValueError(f"{where}.input_activations={inputs!r}: "
                         "expected FP8 activations (num_bits 8, type 'float')")
    dynamic = inputs.get("dynamic", False)
    if dynamic is True:
        return False
    if dynamic is False and (inputs.get("strategy") or "tensor") == "tensor":
        return True
    raise ValueError(f"{where}.input_activations: dynamic={dynamic!r}, "
                     f"strategy={inputs.get('strategy')!r}: expected "
                     "dynamic true, or dynamic false with strategy 'tensor'")


def _ct_block(name: str, group) -> tuple[int, int] | None:
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping) or weights.get("strategy") != "block":
        return None
    return _block_format(weights.get("block_structure"),
                         f"config_groups.{name}.weights.block_structure").block


@dataclass(frozen=True)
class Quantization:
    """A quantization_config read once: the coarse kind for rules, the loader's exact layout."""

    experts: ExpertsQuantization  # never unknown: UNREADABLE with the reason
    checkpoint: CheckpointFormat | None  # None: the loader cannot read it (`error` says why)
    error: str | None = None

    def checkpoint_format(self) -> CheckpointFormat:
        if self.checkpoint is None:
            raise ValueError(self.error)
        return self.checkpoint


def read_quantization(quant_config) -> Quantization:
    experts = experts_quantization(quant_config)
    try:
        return Quantization(experts, checkpoint_format(quant_config))
    except ValueError as error:
        return Quantization(experts, None, str(error))
