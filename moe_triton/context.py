"""What a model (not a layer) tells the library: architecture, quantization, how it is served."""
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
    architecture: str | None = None  # config.architectures[0], e.g. "Cohere2MoeForCausalLM"
    quant_config: object = None  # the checkpoint's quantization_config, from config.json
    all_to_all: str | None = None  # expert-parallel all-to-all backend ("deepep", ...)
    lora: bool = False  # LoRA adapters on the experts
    sharded_experts: bool = False  # experts split over ranks by moe_triton.parallel

    @classmethod
    def from_config(cls, config: Mapping, model_dir: Path | None = None, *,
                    all_to_all: str | None = None, lora: bool = False) -> ModelContext:
        """Also reads model_dir/hf_quant_config.json (ModelOpt) if config.json has no quant."""
        architectures = config.get("architectures") or [None]
        if not isinstance(architectures, list) or not all(isinstance(a, (str, type(None)))
                                                          for a in architectures):
            raise ValueError("config.json's architectures must be a list of class names, "
                             f"got {architectures!r}")
        quant = config.get("quantization_config")
        if (quant is None and model_dir is not None
                and (model_dir / "hf_quant_config.json").exists()):
            quant = _modelopt_file(model_dir / "hf_quant_config.json")
        return cls(architectures[0], quant, all_to_all, lora)

    @functools.cached_property
    def quantization(self) -> Quantization:
        # read once per model: rules, the loader and every layer ask it
        return read_quantization(self.quant_config)

    def experts_format(self) -> WeightFormat:
        """The routed experts' format; a ValueError naming the config key when FP8 cannot run it."""
        return self.quantization.checkpoint_format().experts


def _modelopt_file(path: Path):
    # {"quantization": {"quant_algo": ...}, ...}; its file name when not an object (fail closed)
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return path.name
    return {"quant_method": "modelopt", **content} if isinstance(content, dict) else path.name
