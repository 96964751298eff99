"""`FusedMoE`: the sparse MoE block as one module, holding its weights (transformers' layout,
shared) and calling its runner, where backends, formats and placements differ (runners/)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from . import checks
from . import platform as platforms
from .activation import SILU_AND_MUL, Activation
from .context import ModelContext
from .graphs import run_branches
from .invariance import batch_invariant_enabled
from .placement import Placement
from .routing import RouteTape, RoutingSpec, router_logits, topk_weights_torch
from .runners.resolver import build_runner, resolve
from .runners.runner import ExpertsRunner
from .runners.spec import LayerTraits
from .weights import NATIVE, ExpertWeights, WeightFormat

# FusedMoE parameter (its checkpoint name under the layer) -> ExpertWeights field
EXPERT_TENSORS = {"gate_up_proj": "w13", "down_proj": "w2", "gate_up_proj_scale": "w13_scale",
                  "down_proj_scale": "w2_scale", "input_scale": "input_scale",
                  "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}


class SharedCombination(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"  # Cohere2-MoE's "average" strategy: (routed + shared) / 2


@dataclass(frozen=True)
class MoESpec:
    """A MoE block as its config describes it; each family's `<family>_moe_spec(config)`."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    routing: RoutingSpec
    activation: Activation = SILU_AND_MUL
    shared_intermediate_size: int = 0  # the shared experts' I; 0: none
    shared_combination: SharedCombination = SharedCombination.SUM
    latent_size: int | None = None  # NemotronH: the experts' width, between its projections
    expert_bias: bool = False  # gpt-oss: biases on both expert projections
    router_bias: bool = False  # gpt-oss: a bias on the router's logits

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def layer_args(self) -> dict:
        return dict(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                    intermediate_size=self.intermediate_size, routing=self.routing,
                    activation=self.activation, shared_combination=self.shared_combination,
                    expert_bias=self.expert_bias, router_bias=self.router_bias)


class FusedMoE(nn.Module):
    """Call `prepare_weights()` once after loading; weight_format=None: `held_format`'s."""

    # a Hub MoE block's tensor names -> this layer's, under its prefix (models/checkpoint.py)
    checkpoint_renames: tuple[tuple[str, str], ...] = (
        (r"^gate\.weight$", "gate_weight"),
        (r"^gate\.bias$", "gate_bias"),
        (r"^gate\.e_score_correction_bias$", "e_score_correction_bias"),
        (r"^experts\.(gate_up_proj|down_proj)(_scale|_scale_inv|_bias)?$", r"\1\2"),
        (r"^experts\.input_scale$", "input_scale"),
    )

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 routing: RoutingSpec | None = None, activation: Activation = SILU_AND_MUL,
                 shared_experts: nn.Module | None = None,
                 shared_combination: SharedCombination = SharedCombination.SUM,
                 expert_input_proj: nn.Module | None = None,
                 expert_output_proj: nn.Module | None = None,
                 weight_format: WeightFormat | None = None, placement: Placement = Placement(),
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 expert_bias: bool = False, router_bias: bool = False):
        super().__init__()
        checks.positive_ints("FusedMoE", num_experts=num_experts, top_k=top_k,
                             hidden_size=hidden_size, intermediate_size=intermediate_size)
        checks.instances("FusedMoE", routing=(routing, (RoutingSpec, type(None))),
                         activation=(activation, Activation),
                         weight_format=(weight_format, (WeightFormat, type(None))),
                         placement=(placement, Placement))
        dtype = checks.float_dtype("FusedMoE", "dtype (None: torch's default)",
                                   dtype or torch.get_default_dtype())
        device = platforms.check_device(device)
        weight_format = held_format(placement.context) if weight_format is None else weight_format
        self.routing = routing or RoutingSpec(top_k)
        if self.routing.top_k != top_k or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} (routing.top_k={self.routing.top_k}) must match and "
                             f"lie in [1, {num_experts}]")
        self.activation, self.placement, self.weight_format = activation, placement, weight_format
        self.intermediate_size = intermediate_size  # the whole layer's I (placements hold a slice)
        self.shared_experts, self.shared_combination = (shared_experts,
                                                        SharedCombination(shared_combination))
        self.expert_input_proj, self.expert_output_proj = expert_input_proj, expert_output_proj
        # NemotronH's latent projection narrows the experts' input
        expert_in = getattr(expert_input_proj, "out_features", hidden_size)
        local_experts, local_intermediate = placement.local_sizes(num_experts, intermediate_size,
                                                                  weight_format)
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype,
                                                    device=device))
        self.gate_bias = (nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device))
                          if router_bias else None)
        experts = ExpertWeights.empty(local_experts, expert_in, local_intermediate,
                                      activation.gated, weight_format, dtype, device,
                                      biased=expert_bias)
        for name, field in EXPERT_TENSORS.items():
            tensor = getattr(experts, field)
            # packed MXFP4 bytes cannot require gradients
            self.register_parameter(name, nn.Parameter(tensor, tensor.is_floating_point())
                                    if tensor is not None else None)
        bias = (torch.zeros(num_experts, dtype=torch.float32, device=device)
                if self.routing.correction_bias else None)
        self.register_buffer("e_score_correction_bias", bias)
        traits = LayerTraits(expert_in, dtype, activation, self.routing, weight_format,
                             expert_bias)
        platform = placement.platform or platforms.detect_platform(self.gate_up_proj.device)
        self.resolution = resolve(placement.backend, platform, placement.resolution_context(),
                                  traits)
        self.runner = build_runner(self.resolution, traits, placement)
        self._prepared: ExpertWeights | None = None
        # set for one forward by a model's routing tape (models/layers.py): the routing records
        # each token's experts there and replays them from it
        self.route_tape: RouteTape | None = None
        self._register_load_state_dict_pre_hook(self.take_shard)

    @classmethod
    def from_spec(cls, spec: MoESpec, placement: Placement = Placement(), **kwargs) -> FusedMoE:
        return cls(**spec.layer_args(), placement=placement, **kwargs)

    @property
    def backend(self) -> str:
        return self.resolution.backend

    def expert_weights(self) -> ExpertWeights:
        """The prepared weights (the parameters before prepare_weights()); parameters replaced
        since are prepared anew: the layer never computes with tensors it no longer holds."""
        prepared = self._prepared
        if prepared is not None:
            if all(self._parameters[name] is getattr(prepared, field)
                   for name, field in EXPERT_TENSORS.items()):
                return prepared
            self.prepare_weights()
            return self._prepared
        tensors = {field: getattr(self, name) for name, field in EXPERT_TENSORS.items()}
        return ExpertWeights(gated=self.activation.gated, format=self.weight_format, **tensors)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """After loading: the runner's weights (padded, or its own view); idempotent."""
        self._prepared = None
        prepared = self.runner.prepare(self.expert_weights())
        for name, field in EXPERT_TENSORS.items():  # padded: the layer now holds the copies
            if getattr(prepared, field) is not getattr(self, name):
                setattr(self, name, nn.Parameter(getattr(prepared, field), requires_grad=False))
        self._prepared = self.expert_weights()

    def take_shard(self, state_dict: dict, prefix: str = "", *hook_args) -> None:
        """A load_state_dict hook: full-size expert tensors -> this rank's shard, in place."""
        names = {field: prefix + name for name, field in EXPERT_TENSORS.items()}
        self.placement.cut_shard(state_dict, names, self.expert_weights(),
                                 (len(self.gate_weight), self.intermediate_size))

    def routed_experts(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Router, projections and experts as one schedulable unit: x (T, H) -> a fresh (T, H);
        `topk_ids` (T, K): run these experts instead of the router's top-k."""
        h = self.expert_input_proj(x) if self.expert_input_proj is not None else x
        logits = router_logits(x, self.gate_weight, self.routing, self.gate_bias)  # [T, E]
        bias = self.e_score_correction_bias
        tape = self.route_tape
        if topk_ids is None and tape is None:
            h = self.runner(self.expert_weights(), h, logits, bias)
        else:
            if type(self.runner).__call__ is not ExpertsRunner.__call__:
                raise ValueError(f"the {self.backend} backend routes inside its kernel: given or "
                                 "recorded routing needs one that routes apart (triton, torch)")
            if topk_ids is None:
                topk_ids, topk_weights = self.runner.route(logits, bias, tape)  # [T, K] each
            elif tape is None:
                topk_weights = self.weights_at(logits, topk_ids)
            else:
                raise ValueError("topk_ids were given while a model's routing tape is bound to "
                                 "this layer (route_tape): the tape chooses the experts inside a "
                                 "model forward; call the layer with topk_ids outside one")
            h = self.runner.experts(h, self.expert_weights(), topk_ids, topk_weights)
        return self.expert_output_proj(h) if self.expert_output_proj is not None else h

    def weights_at(self, logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """(T, K) float32 routing weights of the experts `topk_ids` by this router's own rule
        (softmax or sigmoid of their scores, renormalized, scaled), from (T, E) logits; the
        correction bias only ever steers the choice, so it plays no part."""
        return topk_weights_torch(logits, topk_ids, self.routing)

    def forward(self, hidden_states: torch.Tensor, overlap: bool = False,
                topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (..., H). `overlap` runs the routed experts on the "alt" stream beside the
        shared ones; both only read x and return fresh tensors. `topk_ids` (..., K), ids in
        [0, E): these experts instead of the router's (replay), weighted by `weights_at`; their
        range is checked on the host (one sync on a GPU)."""
        checks.layer_input(hidden_states, self.gate_weight)
        if batch_invariant_enabled():
            self.runner.check_batch_invariance()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        if topk_ids is not None:
            checks.expert_ids("topk_ids", topk_ids, tuple(hidden_states.shape[:-1]),
                              self.routing.top_k, len(self.gate_weight), x.device)
            topk_ids = topk_ids.reshape(-1, self.routing.top_k)  # [T, K]
        if self.shared_experts is None:
            return self.routed_experts(x, topk_ids).view_as(hidden_states)
        branches = (lambda: self.shared_experts(x), lambda: self.routed_experts(x, topk_ids))
        shared, routed = run_branches(*branches) if overlap else (branches[0](), branches[1]())
        if not isinstance(shared, torch.Tensor) or shared.shape != x.shape:
            got = tuple(shared.shape) if isinstance(shared, torch.Tensor) else type(shared).__name__
            raise ValueError(f"shared_experts returned {got} for an input of shape "
                             f"{tuple(x.shape)}; it must map (T, H) to (T, H): check its output "
                             "size (hidden_size)")
        out = routed + shared
        return (out / 2 if self.shared_combination is SharedCombination.AVERAGE
                else out).view_as(hidden_states)


def held_format(context: ModelContext) -> WeightFormat:
    """The checkpoint's experts' format, else native (NVFP4 too: FlashInfer quantizes bf16)."""
    checkpoint = context.quantization.checkpoint
    return checkpoint.experts if checkpoint is not None else NATIVE
