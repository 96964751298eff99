"""What a model (not a layer) tells the library: its architecture, its quantization config read
once, and how it is served (all-to-all, LoRA, sharded experts). Backend choice, placement and the
loader all read it; it depends on nothing above the specs.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .quant_config import Quantization, read_quantization
from .weights import WeightFormat


@dataclass(frozen=True)
class ModelContext:
    """What the model (not the layer) tells backend choice, and the MoE layers a model family builds."""

    architecture: str | None = None  # config.architectures[0], e.g. "Cohere2MoeForCausalLM"
    quant_config: object = None  # the checkpoint's quantization_config, as read from config.json
    all_to_all: str | None = None  # expert-parallel all-to-all backend ("deepep", ...), None without one
    lora: bool = False  # LoRA adapters on the experts
    sharded_experts: bool = False  # experts split over ranks by moe_triton.parallel (FusedMoE(parallel=...))

    @classmethod
    def from_config(cls, config: Mapping, model_dir: Path | None = None, *, all_to_all: str | None = None,
                    lora: bool = False) -> "ModelContext":
        """From a checkpoint's config.json; a quantization kept only in model_dir/hf_quant_config.json
        (ModelOpt's export) is read from there as a ModelOpt config, or recorded as that file's name,
        which reads as unreadable, when the file is not a JSON object."""
        architectures = config.get("architectures") or [None]
        if not isinstance(architectures, list) or not all(isinstance(a, (str, type(None))) for a in architectures):
            raise ValueError(f"config.json's architectures must be a list of class names, got {architectures!r}")
        quant = config.get("quantization_config")
        if quant is None and model_dir is not None and (model_dir / "hf_quant_config.json").exists():
            quant = _modelopt_file(model_dir / "hf_quant_config.json")
        return cls(architectures[0], quant, all_to_all, lora)

    @functools.cached_property
    def quantization(self) -> Quantization:
        """The quantization config, read once per model (rules, the loader and every layer ask it)."""
        return read_quantization(self.quant_config)

    def experts_format(self) -> WeightFormat:
        """The routed experts' WeightFormat under the checkpoint's quantization config (what a family builds
        its FusedMoE layers with); a ValueError naming the config key when the FP8 kernels cannot run it."""
        return self.quantization.checkpoint_format().experts


def _modelopt_file(path: Path):
    """hf_quant_config.json ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ...}}) as a
    ModelOpt quantization_config; its file name when it is not a JSON object (unreadable, fail closed)."""
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return path.name
    return {"quant_method": "modelopt", **content} if isinstance(content, dict) else path.name
