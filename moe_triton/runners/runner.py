"""Backend runners: how a backend routes, runs a layer's experts and prepares their weights
(`prepare` once after loading). A new backend is one runner class and one catalog entry."""
from __future__ import annotations

import torch

from ..activation import Activation
from ..context import ModelContext
from ..launch import register_op
from ..parallel import ParallelGroups, parallel_experts
from ..pipeline import run_experts
from ..reference import fused_experts_torch
from ..routing import RouteTape, RoutingSpec, route, route_torch
from ..weights import ExpertWeights
from .padding import pad_expert_weights
from .spec import BackendSpec, LayerTraits

# Not .../backends/: Dynamo skips paths holding "triton/backends" (Triton's), breaking graphs.


def _refuse(x: torch.Tensor, reason: str) -> torch.Tensor:
    raise RuntimeError(reason)


# The fake raises too: tracing it is an error, never a silent graph break.
@register_op("not_compile_safe", _refuse)
def _not_compile_safe(x: torch.Tensor, reason: str) -> torch.Tensor:
    raise RuntimeError(reason)


def refuse_compile(x: torch.Tensor, what: str) -> torch.Tensor:
    return torch.ops.moe_triton.not_compile_safe(
        x, f"moe_triton: {what} is not compile-safe; run it eagerly "
           "(decode through moe_triton.graphs' DecodeGraphRunner where it "
           "can be captured) or compile a model that does not use it")


class ExpertsRunner:
    """Our routing kernel, then `experts`; a backend overrides what it does differently."""

    graph_capturable = True  # the whole forward can be captured in a CUDA graph
    lockstep = False  # its forward holds collectives peers with other tokens must join at once
    # why a row's bits follow the rest of its batch even in batch_invariant(); None: they do not
    batch_dependence: str | None = "its kernels choose tiles by the batch"

    def __init__(self, spec: BackendSpec, layer: LayerTraits, context: ModelContext):
        self.spec, self.layer, self.context = spec, layer, context

    @property
    def activation(self) -> Activation:
        return self.layer.activation

    @property
    def routing(self) -> RoutingSpec:
        return self.layer.routing

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        """I zero-padded to the backend's multiple (the same object when aligned)."""
        return pad_expert_weights(weights, self.spec.intermediate_multiple)

    def check_batch_invariance(self) -> None:
        """Inside batch_invariant(): a ValueError where this backend's rows follow the batch."""
        if self.batch_dependence is not None:
            raise ValueError(f"batch_invariant() is on, but this layer's experts run on the "
                             f"{self.spec.backend} backend, where {self.batch_dependence}: build "
                             "the layer with Placement('triton') (on a CPU with "
                             "TRITON_INTERPRET=1), or call it outside the mode")

    def route(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
              tape: RouteTape | None = None):
        """(T, E) logits -> topk_ids (T, K) int32, topk_weights (T, K) float32; `tape` records
        and replays (routing.RouteTape)."""
        return route(router_logits, self.routing, correction_bias, tape=tape)

    def experts(self, hidden_states: torch.Tensor, weights: ExpertWeights, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """(T, H) -> a fresh (T, H) in hidden_states' dtype, on a given top-k."""
        raise NotImplementedError

    def __call__(self, weights: ExpertWeights, hidden_states: torch.Tensor,
                 router_logits: torch.Tensor,
                 correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        topk_ids, topk_weights = self.route(router_logits, correction_bias)  # [T, K] each
        return self.experts(hidden_states, weights, topk_ids, topk_weights)


class TritonRunner(ExpertsRunner):
    batch_dependence = None  # the mode fixes its tiles (pipeline.default_config)

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        return run_experts(hidden_states, weights, topk_ids, topk_weights,
                           activation=self.activation)


class TorchRunner(ExpertsRunner):
    """The float32 reference, routing included; quantized weights dequantized, activations not."""

    batch_dependence = ("per-expert torch matmuls round a row by how many rows share its expert "
                        "(BLAS picks kernels by the row count)")

    def route(self, router_logits, correction_bias, tape=None):
        return route_torch(router_logits, self.routing, correction_bias, tape)

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        w13, w2 = weights.dequantized()
        if weights.format.quantized:  # as on triton: no gradient for quantized weights, scales
            w13, w2 = w13.detach(), w2.detach()
        out = fused_experts_torch(hidden_states, w13, w2, topk_ids, topk_weights,
                                  activation=self.activation, w13_bias=weights.w13_bias,
                                  w2_bias=weights.w2_bias)  # [T, H] float32
        return out.to(hidden_states.dtype)


class ParallelRunner(ExpertsRunner):
    """A backend's runner on this rank's shard. Not compile-safe (the eager all-to-all reads split
    sizes on the host); captured, the all-to-all is fixed-capacity and EP ranks step in lockstep."""

    def __init__(self, local: ExpertsRunner, groups: ParallelGroups):
        super().__init__(local.spec, local.layer, local.context)
        self.local, self.groups = local, groups
        self.graph_capturable = local.graph_capturable
        self.batch_dependence = ("the mode does not cover moe_triton.parallel's collectives "
                                 "(NCCL picks its reduction algorithm by message size)")
        self.lockstep = groups.spec.all_to_all

    def prepare(self, weights):
        return self.local.prepare(weights)

    def route(self, router_logits, correction_bias, tape=None):
        return self.local.route(router_logits, correction_bias, tape)

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        if torch.compiler.is_compiling():
            return refuse_compile(hidden_states,
                                  "moe_triton.parallel (expert / tensor parallel experts)")
        return parallel_experts(hidden_states, weights, topk_ids, topk_weights, self.groups,
                                experts=self.local.experts)
