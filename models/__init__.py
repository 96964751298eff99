"""MoE model families on the expert layer (`moe_triton.models`): a file per family, registry.py
(load_model, from_transformers), checkpoint.py and fp8.py (loading), shared layers and kernels."""
from . import (  # noqa: F401  (registers)
    cohere2_moe,
    gpt_oss,
    minimax_m2,
    minimax_m3,
    nemotron_h,
    qwen3_moe,
)
from .registry import (
    MODELS,
    default_dtype,
    from_transformers,
    load_model,
    model_class,
    register_model,
)

__all__ = ["MODELS", "default_dtype", "from_transformers", "load_model", "model_class",
           "register_model"]
