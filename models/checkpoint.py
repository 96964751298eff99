"""Checkpoint loading: safetensors (one file, or shards with an index) into a model named as
transformers names it; renames are regex tables (the family's, then each FusedMoE's), and the
per-expert Hub layout is fused into transformers 5's (`experts.gate_up_proj` [E, 2I, H])."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from moe_triton.layer import FusedMoE
from moe_triton.quant_config import CheckpointFormat

from . import fp8
from .layers import QKVProjection

# experts.N.<proj>.<kind> -> (prefix, expert index, proj, kind): the weight or one of its FP8 scales
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)"
                         r"\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<kind>weight|weight_scale_inv|weight_scale|input_scale)$")


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or each one a shard index lists, from its shard (a copy
    in another shard is not read); an unlisted tensor, or one its shard lacks, is an error."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        by_file = _weight_map(index)
    elif (directory / "model.safetensors").exists():
        by_file = {"model.safetensors": None}  # None: every tensor of the file
    else:
        raise ValueError(f"{directory} holds neither model.safetensors nor "
                         "model.safetensors.index.json")
    listed = {key for keys in by_file.values() if keys is not None for key in keys}
    tensors = {}
    for name, keys in by_file.items():
        try:
            with safe_open(directory / name, framework="pt") as f:
                held = f.keys()
                if keys is not None:
                    _check_shard(index.name, name, set(held), keys, listed)
                for key in held:
                    if keys is None or key in keys:
                        tensors[key] = f.get_tensor(key)
        except (OSError, SafetensorError) as error:  # missing shard, truncated or corrupt file
            raise ValueError(f"{directory / name} cannot be read as safetensors: "
                             f"{error}") from None
    return tensors


def _check_shard(index: str, name: str, held: set[str], wanted: set[str],
                 listed: set[str]) -> None:
    missing = sorted(wanted - held)
    if missing:
        raise ValueError(f"{index} maps tensor {missing[0]} to {name}, which does not hold it "
                         f"({len(missing)} such tensors): fix the index's weight_map or the shard")
    unlisted = sorted(held - listed)
    if unlisted:
        raise ValueError(f"{name} holds tensor {unlisted[0]}, which {index} does not list "
                         f"({len(unlisted)} such tensors): add it to the index's weight_map, "
                         "or remove it from the shard")


def _weight_map(index: Path) -> dict[str, set[str]]:
    """Shard file (beside the index) -> the tensor names the weight_map maps to it."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        weight_map = None
    names = list(weight_map.values()) if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise ValueError(f"{index} is not a safetensors index: it needs a \"weight_map\" of "
                         "tensor name -> shard file")
    by_file: dict[str, set[str]] = defaultdict(set)
    for key, file in weight_map.items():
        by_file[file].add(key)
    return dict(sorted(by_file.items()))


def fuse_per_expert(tensors: dict[str, torch.Tensor],
                    checkpoint: CheckpointFormat = CheckpointFormat(),
                    origins: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Per-expert weights stacked into gate_up_proj [E, 2I, H] (non-gated: up_proj [E, I, H]) and
    down_proj [E, H, I], their FP8 scales into FusedMoE's; `origins`: the checkpoint's names."""
    groups: dict[str, dict[tuple[str, str], dict[int, torch.Tensor]]] = defaultdict(
        lambda: defaultdict(dict))
    fused = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            fused[name] = tensor
        else:
            groups[match["prefix"]][match["proj"], match["kind"]][int(match["expert"])] = tensor
    for prefix, parts in groups.items():
        # every projection has them all
        num_experts = max(max(by_expert) for by_expert in parts.values()) + 1
        stack = {key: _stack(prefix, *key, by_expert, num_experts, origins or {})
                 for key, by_expert in parts.items()}
        weights = {proj: stack.pop((proj, kind)) for proj, kind in list(stack) if kind == "weight"}
        shapes = {proj: w.shape[1:] for proj, w in weights.items()}
        fused.update(fp8.expert_scales(prefix, stack, shapes, checkpoint, origins or {}))
        if "gate_proj" in weights:
            if "up_proj" not in weights:
                raise ValueError(f"{prefix}: gate_proj weights without up_proj weights")
            gate, up = weights.pop("gate_proj"), weights.pop("up_proj")
            if gate.shape != up.shape:
                raise ValueError(f"{prefix}.N.gate_proj.weight have shape {tuple(gate.shape[1:])} "
                                 f"but {prefix}.N.up_proj.weight {tuple(up.shape[1:])}")
            fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        for proj, weight in weights.items():
            fused[f"{prefix}.{proj}"] = weight
    return fused


def _stack(prefix: str, proj: str, kind: str, by_expert: dict[int, torch.Tensor],
           num_experts: int, origins: dict[str, str]) -> torch.Tensor:
    first = min(by_expert)
    known = origins.get(f"{prefix}.{first}.{proj}.{kind}", f"{prefix}.{first}.{proj}.{kind}")

    def name(e: int) -> str:  # as the checkpoint names it (MiniMax: ...experts.N.w1...)
        return known.replace(f"experts.{first}.", f"experts.{e}.", 1)

    missing = sorted(set(range(num_experts)) - set(by_expert))
    if missing:
        raise ValueError(f"missing tensor {name(missing[0])}")
    for e, tensor in sorted(by_expert.items()):
        if tensor.shape != by_expert[0].shape or tensor.dtype != by_expert[0].dtype:
            raise ValueError(f"tensor {name(e)} has shape {tuple(tensor.shape)} "
                             f"({tensor.dtype}); {name(0)} has {tuple(by_expert[0].shape)} "
                             f"({by_expert[0].dtype})")
    return torch.stack([by_expert[e] for e in range(num_experts)])


# A per-expert projection -> the fused tensors it is stacked into (up_proj alone: non-gated experts)
_FUSED_INTO = {"gate_proj": ("gate_up_proj",), "up_proj": ("gate_up_proj", "up_proj"),
               "down_proj": ("down_proj",)}


def _check_one_expert_layout(tensors: dict[str, torch.Tensor], renames: Renames,
                             origins: dict[str, str]) -> None:
    """Experts stored fused and per expert are refused: fusing would drop one copy."""
    fused = {renames(name): name for name in tensors if _PER_EXPERT.match(name) is None}
    for name in tensors:
        match = _PER_EXPERT.match(name)
        if match is None or match["kind"] != "weight":
            continue
        for leaf in _FUSED_INTO[match["proj"]]:
            target = renames(f"{match['prefix']}.{leaf}")
            if target in fused:
                both = origins.get(target, fused[target]), origins.get(name, name)
                raise ValueError(f"the checkpoint holds these experts twice, fused as {both[0]} "
                                 f"and per expert as {both[1]}: keep one layout")


@dataclass(frozen=True)
class Renames:
    """Checkpoint name -> parameter name: the model's (pattern, replacement) rules in order, then,
    under a FusedMoE's name, that layer's `checkpoint_renames` on the rest."""

    model: tuple[tuple[str, str], ...]
    layers: dict[str, tuple[tuple[str, str], ...]]  # FusedMoE's name + "." ("": the root) -> rules

    @classmethod
    def of(cls, model: nn.Module, renames) -> Renames:
        layers = {f"{name}." if name else "": module.checkpoint_renames
                  for name, module in model.named_modules() if isinstance(module, FusedMoE)}
        return cls(tuple(renames), layers)

    def __call__(self, name: str) -> str:
        name = _substituted(name, self.model)
        head = name
        while "." in head:  # the innermost FusedMoE holding `name`
            head = head.rpartition(".")[0]
            if f"{head}." in self.layers:
                return f"{head}." + _substituted(name[len(head) + 1:], self.layers[f"{head}."])
        return _substituted(name, self.layers[""]) if "" in self.layers else name


def _substituted(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def rename(tensors: dict[str, torch.Tensor], renames: Renames) -> dict[str, torch.Tensor]:
    return {renames(name): tensor for name, tensor in tensors.items()}


def fuse_qkv(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """q / k / v projections (weights and biases) concatenated, rows q then k then v, into each
    `qkv_proj` the checkpoint does not already hold; a missing or misshapen one is an error."""
    for module_name, module in model.named_modules():
        if not isinstance(module, QKVProjection):
            continue
        prefix = module_name.removesuffix("qkv_proj")
        for suffix, param in module.named_parameters():
            name = f"{module_name}.{suffix}"
            if name in tensors:
                continue
            parts = [f"{prefix}{projection}.{suffix}"
                     for projection in ("q_proj", "k_proj", "v_proj")]
            for part, rows in zip(parts, module.sizes, strict=True):
                if part not in tensors:
                    raise ValueError(f"missing tensor in checkpoint: {part} (q, k and v "
                                     "projections load together)")
                expected = (rows, *param.shape[1:])
                if tuple(tensors[part].shape) != expected:
                    raise ValueError(f"tensor {part} has shape {tuple(tensors[part].shape)}, "
                                     f"the model expects {expected}")
            tensors[name] = torch.cat([tensors.pop(part) for part in parts])
    return tensors


def load_into(model: nn.Module, tensors: dict[str, torch.Tensor], renames: list[tuple[str, str]],
              ignore: tuple[str, ...] = (), checkpoint: CheckpointFormat = CheckpointFormat(),
              dtype: torch.dtype = torch.float32) -> None:
    """The checkpoint into `model`'s parameters and buffers, every mismatch an error naming the
    tensor; `renames`: the model's beyond its FusedMoE layers'; FP8 linears dequantized."""
    # renames run before fusing (Hub -> per-expert names) and after (fused -> this model's names)
    fp8.check_float8_dtypes(tensors)
    renames = Renames.of(model, renames)
    origins = {renames(renames(name)): name for name in tensors}  # for errors: the checkpoint's
    tensors = rename(tensors, renames)
    _check_one_expert_layout(tensors, renames, origins)
    tensors = rename(fuse_per_expert(tensors, checkpoint, origins), renames)
    tensors = fp8.dequantize_linears(fp8.fused_scales(tensors, checkpoint, origins), checkpoint,
                                     dtype, origins)
    tensors = {name: t for name, t in tensors.items()
               if not any(re.search(p, name) for p in ignore)}
    tensors = fuse_qkv(tensors, model)
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):  # under a parallel placement: this rank's experts only
            module.take_shard(tensors, f"{name}." if name else "")
    state = model.state_dict()
    unexpected = sorted(set(tensors) - set(state))
    missing = sorted(set(state) - set(tensors))
    if unexpected:
        raise ValueError(f"unexpected tensor in checkpoint: {unexpected[0]} "
                         f"({len(unexpected)} in all)")
    if missing:
        raise ValueError(f"missing tensor in checkpoint: {missing[0]} ({len(missing)} in all)"
                         + fp8.missing_hint(missing[0], checkpoint))
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(state[name].shape)}")
        # never cast ints into weights
        if tensor.dtype.is_floating_point != state[name].dtype.is_floating_point:
            raise ValueError(f"tensor {name} is {tensor.dtype}, "
                             f"the model expects {state[name].dtype}")
        fp8.check_fp8_dtype(name, tensor, state[name].dtype)
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(tensors[name])
