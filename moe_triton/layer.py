"""`FusedMoE`: the sparse MoE block as one module (router + experts, optional shared experts).

Weights are held in transformers' layout, so a transformers block's tensors are *shared*, not
copied: `gate_up_proj` (E, 2I, H) with [gate; up] along dim 1 (or `up_proj`-style (E, I, H) for
non-gated experts), `down_proj` (E, H, I), router `gate_weight` (E, H).

    x [T, H] -> router logits [T, E] -> route -> ids, weights [T, K]
      -> expert_input_proj? -> experts -> expert_output_proj? -> * routed_scaling_factor
      (+ shared_experts(x), summed or averaged)

The experts run on the backend resolved once at construction (backends/resolver.py; kept as
`layer.resolution`): triton, torch, or a FlashInfer path (flashinfer_trtllm routes inside its
kernel from the logits). `prepare_weights()` after loading pads I to that backend's multiple and
builds FlashInfer's weight view; padding replaces the parameters (no longer shared), the
FlashInfer view is a second copy of the experts.

`parallel=` (a `moe_triton.parallel.ParallelGroups`) shards the experts over ranks: the layer
then holds this rank's (E/ep, 2I/tp, H) / (E/ep, H, I/tp) slice, routes its own tokens with the
full (replicated) router, and its experts step is `parallel_experts` around the same local
pipeline. Without it nothing changes. Loading full-size expert tensors (`load_state_dict`, or
models/'s loader) cuts this rank's shard on the way in (`take_shard`).
"""
from __future__ import annotations

import enum
import functools
import logging
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from . import platform as platforms
from .activation import SILU_AND_MUL, Activation
from .backends.catalog import SPECS, ExpertBackend, LayerTraits, ModelContext
from .backends.flashinfer import FlashInferExperts, FlashInferModules, import_flashinfer, prepare_experts, run_cutlass, \
    run_trtllm, run_trtllm_routed
from .backends.padding import pad_experts
from .backends.quantization import experts_quantization
from .backends.resolver import Resolution, resolve
from .fused_moe import fused_experts
from .parallel import OutputLayout, ParallelGroups, local_sizes, parallel_experts, shard_experts
from .platform import Platform
from .reference import fused_experts_torch
from .routing import RoutingSpec, route, route_torch

logger = logging.getLogger("moe_triton")


@functools.lru_cache(maxsize=None)
def _log_resolution(resolution: Resolution) -> None:
    # once per distinct resolution per process, not once per layer of a 60-layer model
    logger.info("moe_triton experts backend: %s", resolution)


class SharedCombination(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"  # Cohere2-MoE's "average" strategy: (routed + shared) / 2


class FusedMoE(nn.Module):
    """The backend is resolved once here (`self.resolution`, see backends/resolver.py); call
    `prepare_weights()` once after loading weights: it pads I to the backend's multiple and builds
    FlashInfer's weight view (triton and torch need nothing and run without it)."""

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
        context: ModelContext | None = None,
        platform: Platform | None = None,
        parallel: ParallelGroups | None = None,
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
        self.parallel = parallel
        local_experts, local_intermediate = num_experts, intermediate_size
        if parallel is not None:
            if parallel.spec.output is not OutputLayout.FULL:
                raise ValueError(f"parallel.spec.output is {parallel.spec.output.value}; FusedMoE returns every token's "
                                 "full row (shared experts and the residual add to it): use OutputLayout.FULL, or "
                                 "moe_triton.parallel.parallel_experts directly for a scattered output")
            local_experts, local_intermediate = local_sizes(num_experts, intermediate_size, parallel.spec)
        w13_rows = 2 * local_intermediate if activation.gated else local_intermediate
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))  # the full router
        self.gate_up_proj = nn.Parameter(torch.empty(local_experts, w13_rows, expert_in, **factory))
        self.down_proj = nn.Parameter(torch.empty(local_experts, expert_in, local_intermediate, **factory))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        # platform: where the layer will run; detected from `device` unless given (from_transformers
        # builds on the meta device and passes the platform of the block's weights).
        self.context = context or ModelContext()
        if parallel is not None:  # the resolver keeps the paths that have not run sharded out
            self.context = replace(self.context, sharded_experts=True)
        self._register_load_state_dict_pre_hook(self._shard_on_load)
        traits = LayerTraits(expert_in, self.gate_up_proj.dtype, activation.kind, self.routing, correction_bias)
        self.resolution = resolve(backend, platform or platforms.detect_platform(self.gate_up_proj.device),
                                  self.context, traits)
        _log_resolution(self.resolution)
        self.flashinfer_experts: FlashInferExperts | None = None  # set by prepare_weights
        self._flashinfer: FlashInferModules | None = None

    @property
    def backend(self) -> ExpertBackend:
        return self.resolution.backend

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """After loading: zero-pad I to the backend's multiple, then build FlashInfer's view. Idempotent."""
        spec = SPECS[self.backend]
        w13, w2 = pad_experts(self.gate_up_proj, self.down_proj, spec.intermediate_multiple, self.activation.gated)
        if w2 is not self.down_proj:
            self.gate_up_proj = nn.Parameter(w13, requires_grad=False)
            self.down_proj = nn.Parameter(w2, requires_grad=False)
        if spec.flashinfer:
            self._flashinfer = import_flashinfer()
            quant = experts_quantization(self.context.quant_config).format
            self.flashinfer_experts = prepare_experts(self.backend, self.gate_up_proj, self.down_proj,
                                                      self.activation, quant, self._flashinfer)

    @property
    def num_experts(self) -> int:
        """Experts held here: all E, or this rank's E / ep under `parallel`."""
        return self.gate_up_proj.shape[0]

    @property
    def graph_capturable(self) -> bool:
        """All-to-all dispatch reads split sizes on the host, so that mode cannot be captured."""
        return self.parallel is None or not self.parallel.spec.all_to_all

    def take_shard(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        """Under `parallel`: replace full-size expert tensors (E, 2I, H) / (E, H, I) in `state`
        (names `prefix` + gate_up_proj / down_proj) by this rank's shard, cut on the host."""
        names = (prefix + "gate_up_proj", prefix + "down_proj")
        if self.parallel is None or not all(name in state for name in names):
            return
        w13, w2 = (state[name] for name in names)
        if w13.shape == self.gate_up_proj.shape and w2.shape == self.down_proj.shape:
            return  # already this rank's shard
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != self.gate_weight.shape[0]:  # the router sees all E
            return  # malformed: the shape check that follows names the tensor
        state[names[0]], state[names[1]] = shard_experts(w13, w2, self.parallel.spec, self.parallel.rank,
                                                         activation=self.activation)

    def _shard_on_load(self, state_dict, prefix, *args, **kwargs):
        self.take_shard(state_dict, prefix)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> logits (T, E)."""
        if self.router_in_float32:
            return F.linear(x.float(), self.gate_weight.float())
        return F.linear(x.to(self.gate_weight.dtype), self.gate_weight)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: x (T, H) -> topk_ids (T, K) int32, topk_weights (T, K) float32."""
        logits = self.router_logits(x)  # [T, E]
        if self.backend is ExpertBackend.TORCH:
            return route_torch(logits, self.routing, self.e_score_correction_bias)
        return route(logits, self.routing, self.e_score_correction_bias)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts alone, on our top-k (global ids): x (T, H) -> a fresh (T, H).
        Under `parallel` a collective: every rank calls it, with T = 0 where it has no tokens."""
        if self.parallel is not None:
            return parallel_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.parallel,
                                    activation=self.activation, experts=self._local_experts)
        return self._local_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
                                   activation=self.activation)

    def _local_experts(self, x, w13, w2, topk_ids, topk_weights, *, activation: Activation) -> torch.Tensor:
        # fused_experts' signature, so parallel_experts can run it on this rank's shard
        backend = self.backend
        if backend is ExpertBackend.TORCH:
            return fused_experts_torch(x, w13, w2, topk_ids, topk_weights, activation=activation).to(x.dtype)
        if backend is ExpertBackend.TRITON:
            return fused_experts(x, w13, w2, topk_ids, topk_weights, activation=activation)
        if backend is ExpertBackend.FLASHINFER_TRTLLM:
            raise ValueError("flashinfer_trtllm routes inside its kernel from the router logits: call routed_experts(x)")
        run = run_trtllm_routed if backend is ExpertBackend.FLASHINFER_TRTLLM_ROUTED else run_cutlass
        return self._flashinfer_call(run, x, topk_ids, topk_weights)

    def _flashinfer_call(self, run, x: torch.Tensor, *routing_args) -> torch.Tensor:
        if self.flashinfer_experts is None:
            raise RuntimeError(f"backend {self.backend.value} runs on prepared weights: call layer.prepare_weights() "
                               "once after loading them")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"x is {x.dtype}; FlashInfer backends take bfloat16 hidden states")
        if x.shape[0] == 0:
            return torch.empty_like(x)
        return run(self.flashinfer_experts, self._flashinfer, x, *routing_args)

    def routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Router, projections and experts as one schedulable unit: x (T, H) -> (T, H)."""
        h = self.expert_input_proj(x) if self.expert_input_proj is not None else x
        if self.backend is ExpertBackend.FLASHINFER_TRTLLM:  # routing fused into the kernel
            h = self._flashinfer_call(run_trtllm, h, self.router_logits(x), self.routing)
        else:
            topk_ids, topk_weights = self.route(x)
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
