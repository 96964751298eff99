"""The experts' weights as data: their tensors and their format, validated once when built.

    w13 [E, 2I, H]  gate_up_proj, [gate; up] along dim 1 (or [E, I, H] up_proj for non-gated experts)
    w2  [E, H, I]   down_proj

Every backend and `run_experts` take an `ExpertWeights`; the functional `fused_experts(x, w13, w2,
...)` builds one per call. Strides are taken as given, so transformers' transposed storage is a
view, never a copy. A weight format is a value of `WeightFormat` plus the scales it needs, so a
new format adds a value and its kernels, not parameters threaded through every signature.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class WeightFormat(enum.Enum):
    NATIVE = "native"  # bf16 / fp16 / fp32 weights, no scales


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """One MoE layer's expert tensors in one format. E experts, H hidden, I intermediate."""

    w13: torch.Tensor  # [E, 2I, H] gated ([gate; up]), [E, I, H] non-gated
    w2: torch.Tensor  # [E, H, I]
    gated: bool = True  # w13 holds gate and up rows (every activation but relu^2)
    format: WeightFormat = WeightFormat.NATIVE

    def __post_init__(self):
        for name, w in (("w13", self.w13), ("w2", self.w2)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3:
                raise ValueError(f"{name} must be a 3-D tensor (E, N, C), got {_describe(w)}")
        if self.w13.device != self.w2.device:
            raise ValueError(f"w13 is on {self.w13.device} but w2 on {self.w2.device}; move both to one device")
        E, rows, _ = self.w13.shape
        if E <= 0:
            raise ValueError(f"w13 has E={E} experts; the layer needs at least one")
        if self.gated and rows % 2:
            raise ValueError(f"w13 has {rows} rows; a gated activation needs [gate; up] = 2I rows")
        I = rows // 2 if self.gated else rows
        if tuple(self.w2.shape) != (E, self.hidden_size, I):
            raise ValueError(f"w2 must have shape (E, H, I) = {(E, self.hidden_size, I)} to match w13 "
                             f"{tuple(self.w13.shape)}, got {tuple(self.w2.shape)}")
        if self.w13.dtype not in FLOAT_DTYPES or self.w2.dtype != self.w13.dtype:
            raise ValueError(f"native expert weights must share one of {FLOAT_DTYPES}, got w13 {self.w13.dtype} "
                             f"and w2 {self.w2.dtype}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of the weights."""
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"
