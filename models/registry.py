"""Model families by architecture name, and the generic loader.

A new family is one file in models/ with a class decorated `@register_model("ArchName", ...)`
that declares `renames` (checkpoint name -> parameter name regexes); nothing else changes.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..backends.catalog import ModelContext
from ..placement import Placement
from ..layer import FusedMoE
from .checkpoint import load_into, read_safetensors

if TYPE_CHECKING:
    from ..parallel import ParallelGroups

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


def model_class(config) -> type:
    names = getattr(config, "architectures", None) or []
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"unsupported architecture {names or '(none in config.json)'}; "
                     f"supported: {sorted(MODELS)}")


def load_model(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               backend: str = "auto", parallel: ParallelGroups | None = None):
    """Build the registered model for `path`'s config.json and load its safetensors weights; every
    MoE layer resolves `backend` once, at construction (see moe_triton.backends).

    `parallel` (moe_triton.parallel.new_parallel_groups(...), every rank calling with the same
    spec) shards every MoE layer's experts: each rank keeps its slice of the checkpoint's experts,
    and the rest of the model (attention, router, shared experts) is replicated."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json; pass a local checkpoint directory")
    config = AutoConfig.from_pretrained(path)
    cls = model_class(config)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    context = ModelContext.from_config(json.loads((path / "config.json").read_text()), path)
    placement = Placement(backend, context, parallel)
    with torch.device(device), default_dtype(dtype):  # built in its dtype: a bf16 model never exists in fp32
        model = cls(config, placement)
    load_into(model, read_safetensors(path), model.renames, model.ignore)
    for layer in model.modules():
        if isinstance(layer, FusedMoE):
            layer.prepare_weights()  # pads I / builds FlashInfer weights where the resolved backend needs it
    return model.eval()
