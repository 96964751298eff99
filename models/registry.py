"""Model families by architecture name, transformers MoE blocks by class name; the generic loader
and `from_transformers`. A new family is one file: its `<family>_moe_spec(config)` under
`@register_block(...)`, its model under `@register_model(...)` (`renames`: beyond FusedMoE's)."""
from __future__ import annotations

import contextlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_triton import checks
from moe_triton import platform as platforms
from moe_triton.context import ModelContext
from moe_triton.integrations.transformers import (
    experts_activation,
    experts_biases,
    experts_tensors,
)
from moe_triton.layer import FusedMoE, MoESpec
from moe_triton.placement import Placement
from moe_triton.platform import Platform
from moe_triton.quant_config import CheckpointFormat
from moe_triton.runners.resolver import Resolution
from moe_triton.weights import NATIVE

from .causal_lm import StopTokens
from .checkpoint import load_into, read_safetensors

if TYPE_CHECKING:
    from moe_triton.parallel import ParallelGroups

MODELS: dict[str, type] = {}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in `dtype` (large bf16 models never exist in float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def register_model(*architectures: str):
    def register(cls):
        for name in architectures:
            MODELS[name] = cls
        return cls
    return register


@dataclass(frozen=True)
class TransformersBlock:
    """A transformers MoE block: its family's spec, and the dotted paths of its other parts."""

    spec: Callable[..., MoESpec]  # the family's <family>_moe_spec(config)
    router: str = "gate.weight"
    router_bias: str | None = None  # where spec.router_bias
    correction_bias: str | None = None  # where routing.correction_bias
    shared_experts: str | None = None  # where spec.shared_intermediate_size
    expert_input_proj: str | None = None  # where spec.latent_size
    expert_output_proj: str | None = None


BLOCKS: dict[str, TransformersBlock] = {}


def register_block(*class_names: str, **parts: str):
    def register(spec):
        for name in class_names:
            BLOCKS[name] = TransformersBlock(spec, **parts)
        return spec
    return register


def _checkpoint_dir(path) -> Path:
    if not isinstance(path, (str, Path)):
        raise ValueError("path must be a checkpoint directory (str or Path), "
                         f"got {type(path).__name__}")
    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is a file; pass its directory ({path.parent}), which holds "
                         "config.json and the safetensors weights")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; pass a local checkpoint directory")
    return path


def _read_config(path: Path):
    from transformers import AutoConfig

    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'} must hold a JSON object, "
                         f"got {type(raw).__name__}")
    try:
        return AutoConfig.from_pretrained(path), raw
    except Exception as error:  # transformers complains in its own types (StrictDataclassError...)
        message = " ".join(str(error).split())
        raise ValueError(f"{path / 'config.json'} cannot be read by transformers: "
                         f"{message}") from None


def model_class(config) -> type:
    names = getattr(config, "architectures", None) or []
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"unsupported architecture {names or '(none in config.json)'}; "
                     f"supported: {sorted(MODELS)}")


@dataclass(frozen=True)
class ModelPlan:
    path: Path  # the checkpoint directory
    family: type  # the registered class of config.json's architecture
    config: object  # transformers' config
    dtype: torch.dtype  # the one asked for, else config.json's, else float32
    context: ModelContext  # what backend choice reads from config.json
    checkpoint: CheckpointFormat  # how FP8 tensors and their scales are stored

    def build(self, placement: Placement, device) -> torch.nn.Module:
        with torch.device(device), default_dtype(self.dtype):
            return self.family(self.config, placement)


def plan_model(path: str | Path, dtype: torch.dtype | None = None) -> ModelPlan:
    """config.json (and hf_quant_config.json) read as load_model does, refusing what it refuses."""
    dtype = checks.float_dtype("load_model", "dtype", dtype)
    path = _checkpoint_dir(path)
    config, raw_config = _read_config(path)
    family = model_class(config)
    if dtype is None:
        dtype = checks.float_dtype("load_model", "config.json's dtype (or pass dtype=)",
                                   getattr(config, "dtype", None) or torch.float32)
    context = ModelContext.from_config(raw_config, path)
    return ModelPlan(path, family, config, dtype, context, context.quantization.checkpoint_format())


def layer_resolutions(plan: ModelPlan, backend: str = "auto",
                      platform: Platform | None = None) -> list[Resolution]:
    """Each MoE layer's backend on `platform` (None: CPU), built on meta as load_model builds it."""
    platform = platform or platforms.detect_platform("cpu")
    model = plan.build(Placement(backend, plan.context, platform=platform), "meta")
    return [layer.resolution for layer in model.modules() if isinstance(layer, FusedMoE)]


def load_model(path: str | Path, *, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", backend: str = "auto",
               parallel: ParallelGroups | None = None):
    """The registered model for `path`, weights loaded, each MoE layer resolving `backend` once;
    `parallel` (new_parallel_groups(...), alike on every rank) shards the experts only."""
    device = platforms.check_device(device) or torch.device("cpu")
    plan = plan_model(path, dtype)
    model = plan.build(Placement(backend, plan.context, parallel), device)
    path, dtype = plan.path, plan.dtype
    load_into(model, model.checkpoint_tensors(read_safetensors(path)), model.renames, model.ignore,
              plan.checkpoint, dtype)
    for layer in model.modules():
        if isinstance(layer, FusedMoE):
            layer.prepare_weights()  # pads I / builds FlashInfer weights where the backend needs it
    if (path / "generation_config.json").is_file():
        model.stop_tokens = _stop_tokens(path)
    return model.eval()


def _stop_tokens(path: Path) -> StopTokens:
    """generate's eos / pad ids: generation_config.json's, as transformers prefers them."""
    from transformers import GenerationConfig

    name = "generation_config.json"
    try:
        generation = GenerationConfig.from_pretrained(path)
    except Exception as error:  # transformers complains in its own types
        message = " ".join(str(error).split())
        raise ValueError(f"{path / name} cannot be read by transformers: {message}") from None
    return StopTokens.from_generation_config(generation, f"{name}'s ")


def from_transformers(block: nn.Module, backend: str = "auto",
                      context: ModelContext | None = None) -> FusedMoE:
    """A `FusedMoE` computing what `block` computes, sharing its parameters (no copies unless the
    resolved backend pads or prepares them); `context` is what backend choice reads."""
    name = type(block).__name__
    if name not in BLOCKS:
        raise ValueError(f"from_transformers does not know {name}; supported blocks: "
                         f"{sorted(BLOCKS)}")
    entry = BLOCKS[name]
    spec = entry.spec(block.experts.config)
    if experts_activation(block.experts) != spec.activation:
        raise ValueError(f"{name}: its experts apply {experts_activation(block.experts)} but its "
                         f"config gives {spec.activation}: build the block from its config")
    has_bias = getattr(block.experts, "has_bias", False)
    if has_bias != spec.expert_bias:
        raise ValueError(f"{name}: its experts' has_bias={has_bias} but its config gives "
                         f"expert_bias={spec.expert_bias}")
    w13, w2 = experts_tensors(block.experts)
    present = {"shared_experts": spec.shared_intermediate_size > 0,
               "expert_input_proj": spec.latent_size is not None,
               "expert_output_proj": spec.latent_size is not None}
    modules = {slot: _attribute(block, getattr(entry, slot)) for slot, on in present.items() if on}
    # built on the meta device (nothing allocated), resolved for the block's device, then filled
    platform = platforms.detect_platform(w13.device)
    placement = Placement(backend, context or ModelContext(), platform=platform)
    layer = FusedMoE.from_spec(spec, placement, weight_format=NATIVE, dtype=w13.dtype,
                               device="meta", **modules)
    tensors = {"gate_weight": _attribute(block, entry.router), "gate_up_proj": w13, "down_proj": w2}
    if spec.routing.correction_bias:
        tensors["e_score_correction_bias"] = _attribute(block, entry.correction_bias)
    if spec.router_bias:
        tensors["gate_bias"] = _attribute(block, entry.router_bias)
    if spec.expert_bias:  # interleaved rows' biases reordered with them (experts_tensors' copy)
        biases = experts_biases(block.experts)
        tensors |= {"gate_up_proj_bias": biases["w13_bias"], "down_proj_bias": biases["w2_bias"]}
    for slot, tensor in tensors.items():
        held = getattr(layer, slot)
        if tensor.shape != held.shape:
            raise ValueError(f"{name}: {slot} has shape {tuple(tensor.shape)} but its config "
                             f"gives {tuple(held.shape)}")
        if isinstance(held, nn.Parameter) and not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, tensor.requires_grad)  # a transposed view of the block's
        setattr(layer, slot, tensor)
    layer.prepare_weights()
    return layer


def _attribute(block: nn.Module, path: str):
    return operator.attrgetter(path)(block)
