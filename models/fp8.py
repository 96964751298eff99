"""FP8 checkpoints: expert scales into FusedMoE's layout (weights.py), from per-expert
`.weight_scale_inv` (DeepSeek-style) or `.weight_scale` (compressed-tensors, ModelOpt) with
`.input_scale`, or a fused `_scale_inv` grid over [gate; up] rows. The experts stay FP8; a static
input scale is the largest gate / up one (the second GEMM quantizes its input dynamically)."""
from __future__ import annotations

import torch

from moe_triton.quant_config import CheckpointFormat
from moe_triton.weights import FP8_DTYPE, WeightFormat
from moe_triton.weights import dequantize_weight as dequantize

INPUT_SCALE = "input_scale"
# calibrated FP8 KV-cache scales (ModelOpt's kv_cache_quant_algo): the cache keeps the model dtype
_KV_CACHE_SCALES = (".k_scale", ".v_scale")


def expert_scales(prefix: str, scales: dict[tuple[str, str], torch.Tensor],
                  weights: dict[str, torch.Size], checkpoint: CheckpointFormat,
                  origins: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """{(proj, kind): [E, ...]} scales of weights (N, C) = `weights[proj]` -> float32
    `{prefix}.gate_up_proj_scale` (or `up_proj_scale`), `.down_proj_scale`, `.input_scale`."""
    fmt, kind, origins = checkpoint.experts, checkpoint.weight_scale, origins or {}
    if fmt.fp8 is None or not any(k == kind for _, k in scales):
        return {f"{prefix}.{proj}.{k}": scale for (proj, k), scale in scales.items()}
    out = {f"{prefix}.{proj}.{k}": scale for (proj, k), scale in scales.items()
           if k not in (kind, INPUT_SCALE)}
    per_proj = {proj: _checked(prefix, proj, kind, scales.get((proj, kind)), weights[proj],
                               checkpoint, origins)
                for proj in weights}
    gated = "gate_proj" in per_proj
    first = ("gate_proj", "up_proj") if gated else ("up_proj",)  # stacked in this order: [gate; up]
    rows, (H, I) = sum(weights[p][0] for p in first), weights["down_proj"]
    out[f"{prefix}.{'gate_up_proj' if gated else 'up_proj'}_scale"] = fmt.checkpoint_scale(
        [per_proj[p] for p in first], rows, H, gated)
    out[f"{prefix}.down_proj_scale"] = fmt.checkpoint_scale(per_proj["down_proj"], H, I)
    if fmt.input_scale_shape is not None:
        inputs = [_checked(prefix, proj, INPUT_SCALE, scales.get((proj, INPUT_SCALE)), None,
                           checkpoint, origins)
                  for proj in first]
        out[f"{prefix}.input_scale"] = fmt.checkpoint_input_scale(inputs)
    return out


def _checked(prefix: str, proj: str, kind: str, scale: torch.Tensor | None,
             weight: torch.Size | None, checkpoint: CheckpointFormat,
             origins: dict[str, str]) -> torch.Tensor:
    """A stacked scale [E, ...] checked against its weight's (N, C), in float32."""
    weight_name = origins.get(f"{prefix}.0.{proj}.weight", f"{prefix}.0.{proj}.weight")
    name, fmt = weight_name.removesuffix("weight") + kind, checkpoint.experts
    # weight None: an input scale, one per expert
    expected = [(), (1,)] if weight is None else fmt.linear_scale_shapes(*weight)
    if scale is None:
        raise ValueError(f"missing tensor {name}: {fmt} experts ({checkpoint.method}) need it "
                         f"beside {weight_name}, shape {' or '.join(map(str, expected))}")
    if tuple(scale.shape[1:]) not in expected or not scale.dtype.is_floating_point:
        raise ValueError(f"tensor {name} is a {scale.dtype} tensor of shape "
                         f"{tuple(scale.shape[1:])}; {fmt} experts ({checkpoint.method}) expect a "
                         f"float scale of shape {' or '.join(map(str, expected))}"
                         + (f" for their {tuple(weight)} weight" if weight is not None else ""))
    return scale.float()


def fused_scales(tensors: dict[str, torch.Tensor], checkpoint: CheckpointFormat,
                 origins: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Fused grids `X.gate_up_proj_scale_inv`, `X.down_proj_scale_inv` beside FP8 weights
    -> FusedMoE's `X.gate_up_proj_scale`, `X.down_proj_scale`."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj_scale_inv")]:
        weight_name = name.removesuffix("_scale_inv")
        weight = tensors.get(weight_name)
        if weight is None or weight.dim() != 3 or weight.dtype != FP8_DTYPE:
            continue
        scale = out.pop(name)
        out[f"{weight_name}_scale"] = _fused_grid(name, scale, weight, checkpoint, origins or {})
    return out


def _fused_grid(key: str, scale: torch.Tensor, weight: torch.Tensor, checkpoint: CheckpointFormat,
                origins: dict[str, str]):
    name, fmt = origins.get(key, key), checkpoint.experts
    gated = key.endswith(".gate_up_proj_scale_inv")
    try:
        return fmt.checkpoint_scale(scale, *weight.shape[1:], gated)
    except ValueError as error:
        raise ValueError(f"tensor {name}: {error} (the quantization config gives {fmt} experts; "
                         f"for {tuple(weight.shape)} weights)") from None


def dequantize_linears(tensors: dict[str, torch.Tensor], checkpoint: CheckpointFormat,
                       dtype: torch.dtype,
                       origins: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every 2-D FP8 `X.weight` times its scale `X.<weight_scale>`, in `dtype`; their input scales
    and FP8 KV-cache scales dropped. An FP8 weight without a scale is an error."""
    origins = origins or {}
    out = {name: t for name, t in tensors.items() if not name.endswith(_KV_CACHE_SCALES)}
    for name in [n for n, t in tensors.items()
                 if n.endswith(".weight") and t.dtype == FP8_DTYPE and t.dim() == 2]:
        module = name.removesuffix("weight")
        scale_name = module + checkpoint.weight_scale
        original, original_scale = origins.get(name, name), origins.get(scale_name, scale_name)
        if checkpoint.method is None or scale_name not in out:
            why = ("config.json has no quantization_config" if checkpoint.method is None
                   else f"{original_scale} is missing")
            raise ValueError(f"tensor {original} is {FP8_DTYPE} but {why}: expected its scale "
                             f"{original_scale} ({checkpoint.method or 'fp8'} checkpoints)")
        out[name] = dequantize_weight(original_scale, out.pop(name), out.pop(scale_name),
                                      checkpoint).to(dtype)
        out.pop(module + INPUT_SCALE, None)
    return out


def dequantize_weight(scale_name: str, weight: torch.Tensor, scale: torch.Tensor,
                      checkpoint: CheckpointFormat):
    """An FP8 weight (N, C) and its per-tensor, per-row or block scale -> float32 (N, C)."""
    N, C = weight.shape
    blocks = {block: WeightFormat.fp8_block(*block) for block in checkpoint.linear_blocks}
    stored = scale.float().reshape(()) if scale.numel() == 1 else scale.float()  # per tensor
    for fmt in (WeightFormat.fp8_tensor(), WeightFormat.fp8_channel(), *blocks.values()):
        if tuple(stored.shape) in fmt.linear_scale_shapes(N, C):
            return dequantize(weight, stored, fmt)
    expected = [(1,), (N, 1), *(fmt.linear_scale_shapes(N, C)[0] for fmt in blocks.values())]
    grids = f", or the grid of {' / '.join(map(str, blocks))} blocks" if blocks else ""
    raise ValueError(f"tensor {scale_name} has shape {tuple(scale.shape)}; expected one of "
                     f"{expected} (per tensor, per row{grids}) for its ({N}, {C}) FP8 weight")


def check_float8_dtypes(tensors: dict[str, torch.Tensor]) -> None:
    """The FP8 kernels and the dequantizer read e4m3 only: e5m2, fnuz, e8m0 tensors are refused."""
    for name, tensor in tensors.items():
        if (tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1
                and tensor.dtype != FP8_DTYPE):
            raise ValueError(f"tensor {name} is {tensor.dtype}: FP8 checkpoints are read as "
                             f"{FP8_DTYPE} weights with float scales; convert it to e4m3 (and its "
                             "scale), or store it unquantized")


def check_fp8_dtype(name: str, tensor: torch.Tensor, expected: torch.dtype) -> None:
    """FP8 parameters take FP8 tensors and others never do: a cast would drop the scale."""
    if (tensor.dtype == FP8_DTYPE) != (expected == FP8_DTYPE):
        raise ValueError(f"tensor {name} is {tensor.dtype}, the model expects {expected} (the "
                         "experts' format is read from config.json's quantization_config)")


def missing_hint(name: str, checkpoint: CheckpointFormat) -> str:
    if name.endswith("_proj_scale"):
        return (f": the scales of {checkpoint.experts} experts, expected as "
                f"experts.N.<proj>.{checkpoint.weight_scale} per expert, or as one fused "
                "experts.<proj>_scale_inv grid")
    if name.endswith(".input_scale"):
        return (f": {checkpoint.experts} experts take a static input scale, expected as "
                "experts.N.<proj>.input_scale")
    return ""
