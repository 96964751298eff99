"""Argument checks the entry points share: a one-line ValueError naming the argument and fix."""
from __future__ import annotations

import numbers

import torch

from .graphs.capture import is_capture_mode
from .weights import FLOAT_DTYPES


def positive_ints(owner: str, **sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def instances(owner: str, **values) -> None:
    """Every value (name=(value, type or tuple of types)) is an instance of its type(s)."""
    for name, (value, kinds) in values.items():
        if not isinstance(value, kinds):
            kinds = kinds if isinstance(kinds, tuple) else (kinds,)
            expected = " or ".join("None" if kind is type(None) else kind.__name__
                                   for kind in kinds)
            raise ValueError(f"{owner}: {name} must be {expected}, got {type(value).__name__}")


def float_dtype(owner: str, name: str, dtype) -> torch.dtype | None:
    """A model dtype: one of FLOAT_DTYPES or its name ("bfloat16"); None stays None."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in FLOAT_DTYPES:
        raise ValueError(f"{owner}: {name}={dtype!r} is not a model dtype; use one of "
                         f"{FLOAT_DTYPES} (or its name)")
    return resolved


def layer_input(hidden_states, weight: torch.Tensor) -> None:
    H, device = weight.shape[-1], weight.device
    if weight.is_meta:
        raise ValueError("the layer's weights are on the meta device (shapes, no data): "
                         "materialize them with layer.to_empty(device=...) and load weights, "
                         "or build the layer on a real device")
    if (not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1
            or hidden_states.shape[-1] != H):
        got = (f"shape {tuple(hidden_states.shape)}" if isinstance(hidden_states, torch.Tensor)
               else type(hidden_states).__name__)
        raise ValueError(f"hidden_states must be a tensor of shape (..., H={H}), got {got}")
    if not hidden_states.dtype.is_floating_point:
        raise ValueError(f"hidden_states dtype {hidden_states.dtype} is not floating point; "
                         f"the layer computes in {weight.dtype}")
    if hidden_states.device != device:
        raise ValueError(f"hidden_states is on {hidden_states.device} but the layer's weights on "
                         f"{device}; move one of them (layer.to(...))")


def expert_ids(name: str, ids, leading: tuple[int, ...], top_k: int, num_experts: int,
               device: torch.device) -> None:
    """Given experts (replay): integer (..., top_k) ids in [0, num_experts) on `device`; the
    range is read on the host (one sync where the ids live on a GPU)."""
    shape = (*leading, top_k)
    if (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != shape
            or ids.dtype not in (torch.int32, torch.int64) or ids.device != device):
        got = (f"{ids.dtype} {tuple(ids.shape)} on {ids.device}" if isinstance(ids, torch.Tensor)
               else type(ids).__name__)
        raise ValueError(f"{name} must be an int32/int64 tensor of shape {shape} on {device}, "
                         f"got {got}")
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"{name} must hold expert ids in [0, {num_experts}), got values in "
                         f"[{ids.min().item()}, {ids.max().item()}]")


def grad_needed(*tensors) -> bool:
    if torch.is_grad_enabled():  # a loop, not any(...): this runs on every eager call
        for t in tensors:
            if getattr(t, "requires_grad", False):
                return True
    return False


def no_grad_needed(what: str, fix: str, *tensors) -> None:
    """An inference-only tool refuses a call that needs gradients rather than detach them."""
    if grad_needed(*tensors):
        raise ValueError(f"{what} has no backward, but grad mode is on and an input or weight "
                         f"requires grad: run it under torch.no_grad(), or {fix}")


def not_capturing(what: str) -> None:
    """A differentiable call cannot be captured in a CUDA graph: its backward reads host sizes."""
    if is_capture_mode() or (torch.cuda.is_available()
                             and torch.cuda.is_current_stream_capturing()):
        raise ValueError(f"{what} with gradients cannot be captured in a CUDA graph (its backward "
                         "reads sizes on the host): capture under torch.no_grad()")
