"""`FusedMoE`: the sparse MoE block as one module, holding its weights and calling its runner.

    x [T, H] -> router logits [T, E] -> runner: route, experts [T, H]   (inside expert_input/output_proj)
      (+ shared_experts(x), summed or averaged; on the "alt" stream beside the routed experts when overlapping)

Weights are held in transformers' layout, so a transformers block's tensors are shared, not copied:
`gate_up_proj` (E, 2I, H) [gate; up] (or (E, I, H) non-gated), `down_proj` (E, H, I), router
`gate_weight` (E, H). Backends, formats and placements differ only inside the runner
(backends/runners.py); the routing rule, bias and scaling live in the `RoutingSpec`.
"""
from __future__ import annotations

import enum
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from . import platform as platforms
from .activation import SILU_AND_MUL, Activation
from .backends.catalog import LayerTraits
from .backends.resolver import resolve
from .backends.runners import build_runner
from .graphs import run_branches
from .placement import Placement
from .routing import RoutingSpec
from .weights import FLOAT_DTYPES, ExpertWeights


class SharedCombination(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"  # Cohere2-MoE's "average" strategy: (routed + shared) / 2


class FusedMoE(nn.Module):
    """Call `prepare_weights()` once after loading weights: the runner pads I to its backend's
    multiple and builds any view of its own (triton and torch run without it too)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 routing: RoutingSpec | None = None, activation: Activation = SILU_AND_MUL,
                 shared_experts: nn.Module | None = None, shared_combination: SharedCombination = SharedCombination.SUM,
                 expert_input_proj: nn.Module | None = None, expert_output_proj: nn.Module | None = None,
                 placement: Placement = Placement(), dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        _check_layer_args(num_experts, top_k, hidden_size, intermediate_size, routing, activation, placement, dtype)
        device = platforms.check_device(device)
        self.routing = routing or RoutingSpec(top_k)
        if self.routing.top_k != top_k or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} (routing.top_k={self.routing.top_k}) must match and lie in [1, {num_experts}]")
        self.activation, self.placement = activation, placement
        self.shared_experts, self.shared_combination = shared_experts, SharedCombination(shared_combination)
        self.expert_input_proj, self.expert_output_proj = expert_input_proj, expert_output_proj
        expert_in = getattr(expert_input_proj, "out_features", hidden_size)  # NemotronH's latent projection narrows it
        local_experts, local_intermediate = placement.local_sizes(num_experts, intermediate_size)
        factory = dict(dtype=dtype, device=device)
        w13_rows = 2 * local_intermediate if activation.gated else local_intermediate
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))  # the full router
        self.gate_up_proj = nn.Parameter(torch.empty(local_experts, w13_rows, expert_in, **factory))
        self.down_proj = nn.Parameter(torch.empty(local_experts, expert_in, local_intermediate, **factory))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if self.routing.correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        traits = LayerTraits(expert_in, self.gate_up_proj.dtype, activation, self.routing)
        platform = placement.platform or platforms.detect_platform(self.gate_up_proj.device)
        self.resolution = resolve(placement.backend, platform, placement.resolution_context(), traits)
        self.runner = build_runner(self.resolution, traits, placement)
        self._prepared: ExpertWeights | None = None  # set by prepare_weights
        self._register_load_state_dict_pre_hook(self.take_shard)

    @property
    def backend(self) -> str:
        return self.resolution.backend

    def expert_weights(self) -> ExpertWeights:
        """The prepared weights, or the parameters as they are before prepare_weights()."""
        return self._prepared or ExpertWeights(self.gate_up_proj, self.down_proj, gated=self.activation.gated)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """After loading: the runner's weights (padded, or its own view); idempotent."""
        prepared = self.runner.prepare(ExpertWeights(self.gate_up_proj, self.down_proj, gated=self.activation.gated))
        if prepared.w2 is not self.down_proj:  # padded: the layer now holds (no longer shares) the padded copies
            self.gate_up_proj = nn.Parameter(prepared.w13, requires_grad=False)
            self.down_proj = nn.Parameter(prepared.w2, requires_grad=False)
            prepared = ExpertWeights(self.gate_up_proj, self.down_proj, prepared.gated, prepared.format)
        self._prepared = prepared

    def take_shard(self, state_dict: dict, prefix: str = "", *hook_args) -> None:
        """Full-size expert tensors in a state dict -> this rank's shard, in place (a load_state_dict hook)."""
        self.placement.cut_shard(state_dict, (prefix + "gate_up_proj", prefix + "down_proj"),
                                 (self.gate_up_proj.shape, self.down_proj.shape), self.gate_weight.shape[0],
                                 self.activation)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> logits (T, E)."""
        if self.routing.router_in_float32:
            return F.linear(x.float(), self.gate_weight.float())
        return F.linear(x.to(self.gate_weight.dtype), self.gate_weight)

    def routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Router, projections and experts as one schedulable unit: x (T, H) -> a fresh (T, H)."""
        h = self.expert_input_proj(x) if self.expert_input_proj is not None else x
        h = self.runner(self.expert_weights(), h, self.router_logits(x), self.e_score_correction_bias)
        return self.expert_output_proj(h) if self.expert_output_proj is not None else h

    def _check_input(self, hidden_states) -> None:
        H, device = self.gate_weight.shape[1], self.gate_weight.device
        if self.gate_up_proj.is_meta or self.gate_weight.is_meta:
            raise ValueError("the layer's weights are on the meta device (shapes, no data): materialize them with "
                             "layer.to_empty(device=...) and load weights, or build the layer on a real device")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1 or hidden_states.shape[-1] != H:
            got = (f"shape {tuple(hidden_states.shape)}" if isinstance(hidden_states, torch.Tensor)
                   else type(hidden_states).__name__)
            raise ValueError(f"hidden_states must be a tensor of shape (..., H={H}), got {got}")
        if not hidden_states.dtype.is_floating_point:
            raise ValueError(f"hidden_states dtype {hidden_states.dtype} is not floating point; the layer computes in "
                             f"{self.gate_up_proj.dtype}")
        if hidden_states.device != device:
            raise ValueError(f"hidden_states is on {hidden_states.device} but the layer's weights on {device}; "
                             f"move one of them (layer.to(...))")

    def forward(self, hidden_states: torch.Tensor, overlap: bool = False) -> torch.Tensor:
        """hidden_states (..., H) -> (..., H). `overlap` (captured decode) runs the routed experts on
        the "alt" stream while the shared experts run here; both only read x and return fresh tensors."""
        self._check_input(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        if self.shared_experts is None:
            return self.routed_experts(x).view_as(hidden_states)
        branches = (lambda: self.shared_experts(x), lambda: self.routed_experts(x))
        shared, routed = run_branches(*branches) if overlap else (branches[0](), branches[1]())
        out = routed + shared
        return (out / 2 if self.shared_combination is SharedCombination.AVERAGE else out).view_as(hidden_states)


def _check_layer_args(num_experts, top_k, hidden_size, intermediate_size, routing, activation, placement, dtype):
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"FusedMoE: {name} must be a positive integer, got {value!r}")
    if routing is not None and not isinstance(routing, RoutingSpec):
        raise ValueError(f"FusedMoE: routing must be a RoutingSpec or None, got {type(routing).__name__}")
    if not isinstance(activation, Activation):
        raise ValueError(f"FusedMoE: activation must be an Activation, got {type(activation).__name__}")
    if not isinstance(placement, Placement):
        raise ValueError(f"FusedMoE: placement must be a Placement (e.g. Placement(backend='torch')), "
                         f"got {type(placement).__name__}")
    if (torch.get_default_dtype() if dtype is None else dtype) not in FLOAT_DTYPES:
        raise ValueError(f"FusedMoE: dtype must be one of {FLOAT_DTYPES} (None: torch's default dtype), got {dtype!r}")
