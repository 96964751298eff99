"""Stage 4, activation: gate_up [M, 2I] -> [M, I] (gated) or [M, I] -> [M, I] (non-gated).

Gated rows follow transformers' `gate_up_proj`: gate = the first I columns, up = the last I. The
standalone kernel and the first expert GEMM's epilogue call the same `_apply_activation`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, interpreter_serialized


class ActivationKind(enum.Enum):
    SILU_AND_MUL = 0  # silu(gate) * up
    GELU_AND_MUL = 1  # gelu(gate) * up, exact erf gelu (transformers "gelu")
    GELU_TANH_AND_MUL = 2  # tanh-approximated gelu (transformers "gelu_pytorch_tanh")
    RELU2 = 3  # relu(x)^2, non-gated (NemotronH experts)
    CLAMPED_SWIGLU = 4  # MiniMax-M3: (clamp(up, -l, l) + 1) g sigmoid(alpha g), g = min(gate, l)


@dataclass(frozen=True)
class Activation:
    kind: ActivationKind = ActivationKind.SILU_AND_MUL
    swiglu_limit: float = 7.0  # CLAMPED_SWIGLU only
    swiglu_alpha: float = 1.702  # CLAMPED_SWIGLU only

    @property
    def gated(self) -> bool:
        return self.kind is not ActivationKind.RELU2

    def kernel_args(self) -> dict:
        return dict(ACT_KIND=self.kind.value, ACT_LIMIT=float(self.swiglu_limit),
                    ACT_ALPHA=float(self.swiglu_alpha))

    @classmethod
    def from_hidden_act(cls, hidden_act: str) -> Activation:
        """The spec for a transformers `hidden_act` string (gated for all but relu2)."""
        kinds = {
            "silu": ActivationKind.SILU_AND_MUL,
            "swish": ActivationKind.SILU_AND_MUL,
            "gelu": ActivationKind.GELU_AND_MUL,
            "gelu_pytorch_tanh": ActivationKind.GELU_TANH_AND_MUL,
            "gelu_new": ActivationKind.GELU_TANH_AND_MUL,
            "relu2": ActivationKind.RELU2,
        }
        if hidden_act not in kinds:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; "
                             f"use one of {sorted(kinds)}")
        return cls(kinds[hidden_act])


SILU_AND_MUL = Activation(ActivationKind.SILU_AND_MUL)


def activation_torch(gate_up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Reference of `activate`, in float32."""
    x = gate_up.float()
    kind = activation.kind
    if kind is ActivationKind.RELU2:
        return torch.relu(x).square()
    gate, up = x.chunk(2, dim=-1)
    if kind is ActivationKind.SILU_AND_MUL:
        return torch.nn.functional.silu(gate) * up
    if kind is ActivationKind.GELU_AND_MUL:
        return torch.nn.functional.gelu(gate) * up
    if kind is ActivationKind.GELU_TANH_AND_MUL:
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=activation.swiglu_limit)
    up = up.clamp(min=-activation.swiglu_limit, max=activation.swiglu_limit)
    # transformers' association (gpt-oss, MiniMax-M3): (up + 1) * (g * sigmoid(g * alpha))
    return (up + 1.0) * (gate * torch.sigmoid(gate * activation.swiglu_alpha))


def activation_backward_torch(gate_up: torch.Tensor, grad: torch.Tensor,
                              activation: Activation) -> torch.Tensor:
    """The gradient of `activation_torch` at gate_up, given its output's (M, I); float32."""
    x, dy = gate_up.float(), grad.float()
    kind = activation.kind
    if kind is ActivationKind.RELU2:
        return 2 * torch.relu(x) * dy  # [M, I]
    gate, up = x.chunk(2, dim=-1)  # [M, I] each
    if kind is ActivationKind.CLAMPED_SWIGLU:  # clamps pass gradient inside their bounds (as torch)
        limit, alpha = activation.swiglu_limit, activation.swiglu_alpha
        g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)  # [M, I]
        s = torch.sigmoid(alpha * g)  # [M, I]
        dgate = dy * (u + 1.0) * (s + alpha * g * s * (1 - s)) * (gate <= limit)  # [M, I]
        dup = dy * g * s * ((up >= -limit) & (up <= limit))  # [M, I]
        return torch.cat([dgate, dup], dim=-1)  # [M, 2I]
    if kind is ActivationKind.SILU_AND_MUL:
        s = torch.sigmoid(gate)  # [M, I]
        act, dact = gate * s, s * (1 + gate * (1 - s))  # silu and its derivative, [M, I]
    elif kind is ActivationKind.GELU_AND_MUL:
        cdf = 0.5 * (1 + torch.erf(gate * 0.7071067811865476))  # [M, I]
        act, dact = gate * cdf, cdf + gate * torch.exp(-0.5 * gate * gate) * 0.3989422804014327
    else:  # GELU_TANH_AND_MUL
        c, k = 0.7978845608028654, 0.044715
        t = torch.tanh(c * (gate + k * gate * gate * gate))  # [M, I]
        act, dact = (0.5 * gate * (1 + t),
                     0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * c * (1 + 3 * k * gate * gate))
    return torch.cat([dy * up * dact, dy * act], dim=-1)  # [M, 2I]


@triton.jit
def _apply_activation(gate, up, KIND: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """float32 in, float32 out; `up` is ignored for the non-gated RELU2."""
    if KIND == 0:
        return gate * tl.sigmoid(gate) * up
    elif KIND == 1:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    elif KIND == 2:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        return 0.5 * gate * (1.0 + tanh) * up
    elif KIND == 3:  # NaN propagates as in torch: a plain max/min returns the other operand
        relu = tl.maximum(gate, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return relu * relu
    else:
        gate = tl.minimum(gate, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(up, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                        propagate_nan=tl.PropagateNan.ALL)
        return (up + 1.0) * (gate * tl.sigmoid(gate * ALPHA))


@interpreter_serialized
@triton.jit
def _activation_kernel(
    x_ptr, out_ptr, M, I,
    stride_x_m, stride_out_m,
    ACT_KIND: tl.constexpr, GATED: tl.constexpr, ACT_LIMIT: tl.constexpr, ACT_ALPHA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_m[:, None] < M) & (offs_i[None, :] < I)
    rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x_m
    gate = tl.load(rows + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    up = gate
    if GATED:
        up = tl.load(rows + I + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _apply_activation(gate, up, ACT_KIND, ACT_LIMIT, ACT_ALPHA)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_out_m + offs_i[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def activate(gate_up: torch.Tensor, activation: Activation = SILU_AND_MUL, *,
             out: torch.Tensor | None = None):
    """Apply `activation` row-wise: (M, 2I) -> (M, I) when gated, (M, I) -> (M, I) otherwise."""
    if gate_up.dim() != 2 or not gate_up.dtype.is_floating_point:
        raise ValueError(f"gate_up must be a 2-D floating tensor (M, 2I) or (M, I), "
                         f"got {tuple(gate_up.shape)} {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError("gate_up must have unit stride along its last dimension; "
                         "pass gate_up.contiguous()")
    M, N = gate_up.shape
    if activation.gated and N % 2:
        raise ValueError(f"gate_up has {N} columns; "
                         "a gated activation needs an even count [gate | up]")
    I = N // 2 if activation.gated else N
    if out is None:
        out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)  # [M, I]
    elif (out.shape != (M, I) or out.dtype != gate_up.dtype or out.device != gate_up.device
          or out.stride(1) != 1):
        raise ValueError(f"out must be a ({M}, {I}) {gate_up.dtype} tensor on {gate_up.device} "
                         "with unit last stride")
    if M == 0 or I == 0:
        return out
    BLOCK_M, BLOCK_I = 16, min(256, triton.next_power_of_2(I))
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(I, BLOCK_I))
    fixed = dict(M=M, I=I, stride_x_m=gate_up.stride(0), stride_out_m=out.stride(0),
                 GATED=activation.gated, BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I,
                 **activation.kernel_args())
    BoundLaunch(_activation_kernel, grid, fixed)(x_ptr=gate_up, out_ptr=out)
    return out
