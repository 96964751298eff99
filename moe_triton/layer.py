"""`FusedMoE`: the sparse MoE block as one module (router + experts, optional shared experts).

Weights are held in transformers' layout, so a transformers block's tensors are *shared*, not
copied: `gate_up_proj` (E, 2I, H) with [gate; up] along dim 1 (or `up_proj`-style (E, I, H) for
non-gated experts), `down_proj` (E, H, I), router `gate_weight` (E, H).

    x [T, H] -> router logits [T, E] -> route -> ids, weights [T, K]
      -> expert_input_proj? -> experts -> expert_output_proj? -> * routed_scaling_factor
      (+ shared_experts(x), summed or averaged)
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from .activation import SILU_AND_MUL, Activation
from .fused_moe import fused_experts
from .platform import triton_can_run_on
from .reference import fused_experts_torch
from .routing import RoutingSpec, route, route_torch


class ExpertBackend(enum.Enum):
    TRITON = "triton"  # our pipeline (routing, expand, GEMMs, activation, finalize)
    TORCH = "torch"  # the float32 reference, cast back to the input dtype


class SharedCombination(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"  # Cohere2-MoE's "average" strategy: (routed + shared) / 2


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        routing: RoutingSpec | None = None,
        activation: Activation = SILU_AND_MUL,
        correction_bias: bool = False,
        router_in_float32: bool = False,
        routed_scaling_factor: float = 1.0,
        shared_experts: nn.Module | None = None,
        shared_combination: SharedCombination = SharedCombination.SUM,
        expert_input_proj: nn.Module | None = None,
        expert_output_proj: nn.Module | None = None,
        expert_hidden_size: int | None = None,
        backend: ExpertBackend | str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if num_experts <= 0:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.routing = routing or RoutingSpec(top_k=top_k)
        if self.routing.top_k != top_k:
            raise ValueError(f"routing.top_k={self.routing.top_k} differs from top_k={top_k}")
        self.activation = activation
        self.router_in_float32 = router_in_float32  # NemotronH routes in float32
        self.routed_scaling_factor = routed_scaling_factor
        self.shared_experts = shared_experts
        self.shared_combination = SharedCombination(shared_combination)
        self.expert_input_proj = expert_input_proj
        self.expert_output_proj = expert_output_proj
        factory = dict(dtype=dtype, device=device)
        expert_in = expert_hidden_size or hidden_size  # NemotronH's latent projections narrow the experts
        w13_rows = 2 * intermediate_size if activation.gated else intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, w13_rows, expert_in, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, expert_in, intermediate_size, **factory))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.backend = self.resolve_backend(backend, self.gate_up_proj.device)

    @staticmethod
    def resolve_backend(backend: ExpertBackend | str, device: torch.device) -> ExpertBackend:
        if backend == "auto":
            return ExpertBackend.TRITON if triton_can_run_on(device) else ExpertBackend.TORCH
        backend = ExpertBackend(backend)
        if backend is ExpertBackend.TRITON and not triton_can_run_on(device):
            raise ValueError(f"backend='triton' cannot run on {device}: use a CUDA device, TRITON_INTERPRET=1, "
                             "or backend='torch'")
        return backend

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: x (T, H) -> topk_ids (T, K) int32, topk_weights (T, K) float32."""
        if self.router_in_float32:
            logits = F.linear(x.float(), self.gate_weight.float())  # [T, E]
        else:
            logits = F.linear(x.to(self.gate_weight.dtype), self.gate_weight)  # [T, E]
        if self.backend is ExpertBackend.TORCH:
            return route_torch(logits, self.routing, self.e_score_correction_bias)
        return route(logits, self.routing, self.e_score_correction_bias)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts alone: x (T, H) -> a fresh (T, H)."""
        if self.backend is ExpertBackend.TORCH:
            out = fused_experts_torch(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
                                      activation=self.activation)
            return out.to(x.dtype)
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, activation=self.activation)

    def routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Router, projections and experts as one schedulable unit: x (T, H) -> (T, H)."""
        topk_ids, topk_weights = self.route(x)
        h = self.expert_input_proj(x) if self.expert_input_proj is not None else x
        h = self.experts(h, topk_ids, topk_weights)
        if self.expert_output_proj is not None:
            h = self.expert_output_proj(h)
        return h * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else h

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (..., H) -> (..., H)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        out = self.routed_experts(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
            if self.shared_combination is SharedCombination.AVERAGE:
                out = out / 2
        return out.reshape(shape)
