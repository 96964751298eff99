"""layer.py: FusedMoE holds its weights and calls its runner; routing, shared experts and backends
each have one owner. The whole layer against the float32 reference, and a backend added from a
test."""
from dataclasses import replace

import pytest
import torch
from helpers import DEEPSEEK_FP8, assert_close, relative_error

from moe_triton import (
    SILU_AND_MUL,
    Activation,
    ActivationKind,
    ExpertWeights,
    FusedMoE,
    ModelContext,
    MoESpec,
    Placement,
    RoutingSpec,
    Scoring,
    SelectOn,
    SharedCombination,
    WeightFormat,
    fused_experts_torch,
    route_torch,
)
from moe_triton.platform import Platform
from moe_triton.routing import topk_weights_torch
from moe_triton.runners import SPECS, ExpertBackend, ExpertsRunner, register_backend
from moe_triton.weights import FP8_DTYPE, NATIVE

E, K, H, I = 8, 2, 32, 24


def make_layer(backend="triton", *, routing=RoutingSpec(K, renormalize=True), shared=None,
               combination="sum", seed=0):
    layer = FusedMoE(E, routing.top_k, H, I, routing=routing, shared_experts=shared,
                     shared_combination=combination, placement=Placement(backend))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.3)
    return layer


def reference(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer computed by hand in float32: router, routing reference, experts reference, shared
    experts."""
    logits = x.float() @ layer.gate_weight.float().T  # [T, E]
    ids, weights = route_torch(logits, layer.routing, layer.e_score_correction_bias)  # [T, K]
    out = fused_experts_torch(x, layer.gate_up_proj, layer.down_proj, ids, weights)  # [T, H]
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x).float()
        if layer.shared_combination is SharedCombination.AVERAGE:
            out = out / 2
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("combination", ["sum", "average", None])
def test_layer_matches_its_parts(backend, combination):
    shared = torch.nn.Linear(H, H) if combination else None
    layer = make_layer(backend, shared=shared, combination=combination or "sum")
    # (..., H): leading dims kept
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x)
        assert out.shape == x.shape
        assert_close(out.reshape(-1, H), reference(layer, x.reshape(-1, H)), torch.float32, scale=2)
        assert torch.equal(layer(x, overlap=True), out)  # serial without CUDA: the same sum


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("routing", [RoutingSpec(K, renormalize=True),
                                     RoutingSpec(K, Scoring.SIGMOID, renormalize=True,
                                                 routed_scaling_factor=2.5, correction_bias=True),
                                     RoutingSpec(K, select_on=SelectOn.LOGITS)],
                         ids=["softmax", "biased-sigmoid", "topk-softmax"])
def test_given_experts_run_weighted_by_the_routers_rule(backend, routing):
    """FusedMoE(x, topk_ids=...): the given experts instead of the router's top-k, weighted as the
    router weighs them (the bias only steers the choice); the router's own choice gives the free
    call's output."""
    layer = make_layer(backend, routing=routing)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    given = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(10)]).view(2, 5, K)
    with torch.no_grad():
        out = layer(x, topk_ids=given)
        logits = x.reshape(-1, H).float() @ layer.gate_weight.float().T  # [T, E]
        weights = topk_weights_torch(logits, given.reshape(-1, K), routing)
        expected = fused_experts_torch(x.reshape(-1, H), layer.gate_up_proj, layer.down_proj,
                                       given.reshape(-1, K), weights)
        assert_close(out.reshape(-1, H), expected, torch.float32, scale=2)
        free_ids, _ = route_torch(logits, routing, layer.e_score_correction_bias)
        assert_close(layer(x, topk_ids=free_ids.view(2, 5, K)), layer(x), torch.float32)


def test_bad_given_experts_are_named_before_anything_launches(no_launch):
    layer = make_layer()
    x = torch.randn(3, H)
    ids = torch.zeros(3, K, dtype=torch.int64)
    for bad, match in ((ids[:2], "shape"), (ids.float(), "int32/int64"), (ids + E, r"\[0, 8\)"),
                       (ids - 1, r"\[0, 8\)"), ("0", "shape")):
        with pytest.raises(ValueError, match=f"topk_ids.*{match}"):
            layer(x, topk_ids=bad)


def test_routed_scaling_is_applied_once_by_the_routing():
    spec = RoutingSpec(K, Scoring.SIGMOID, renormalize=True, correction_bias=True)
    plain, scaled = (make_layer(routing=spec),
                     make_layer(routing=replace(spec, routed_scaling_factor=2.5)))
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(scaled(x), 2.5 * plain(x), torch.float32)


def test_prepare_weights_is_idempotent_and_shares_aligned_tensors():
    layer = make_layer()
    w13 = layer.gate_up_proj
    layer.prepare_weights()
    layer.prepare_weights()
    assert layer.gate_up_proj is w13 and layer.expert_weights().w13 is w13


@pytest.mark.parametrize("backend", ["triton", "torch", "negated_torch"])
@pytest.mark.parametrize("how", ["load_state_dict(assign=True)", "setattr"])
def test_weights_replaced_after_prepare_weights_are_the_ones_that_run(backend, how, toy_backend):
    layer, other = make_layer(backend, seed=0), make_layer(backend, seed=5)
    layer.prepare_weights()
    other.prepare_weights()  # the toy backend pads: both hold padded tensors of one shape
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = layer(x)
        if how == "setattr":
            for name in ("gate_weight", "gate_up_proj", "down_proj"):
                setattr(layer, name, torch.nn.Parameter(getattr(other, name).detach().clone()))
        else:
            layer.load_state_dict({k: v.clone() for k, v in other.state_dict().items()},
                                  assign=True)
        after, expected = layer(x), other(x)
    # the two weight sets differ, so a stale layer would show
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)


# ---- adding a backend: one runner and one catalog entry, nothing in the layer -----------------

class NegatedTorchRunner(ExpertsRunner):
    """A toy backend: the reference experts, negated (so its output is told apart), on weights it
    prepares itself: I padded to a multiple of 16 like a real kernel's alignment."""

    prepared_count = 0

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        NegatedTorchRunner.prepared_count += 1
        return super().prepare(weights)  # pads to the spec's intermediate_multiple

    def experts(self, hidden_states, weights, topk_ids, topk_weights):
        out = fused_experts_torch(hidden_states, weights.w13, weights.w2, topk_ids, topk_weights,
                                  activation=self.activation)
        return (-out).to(hidden_states.dtype)


@pytest.fixture
def toy_backend():
    toy = replace(SPECS[ExpertBackend.TORCH], backend="negated_torch", runner=NegatedTorchRunner,
                  intermediate_multiple=16)
    register_backend(toy)
    yield toy
    del SPECS[toy.backend]


def test_a_backend_defined_here_runs_in_the_layer(toy_backend):
    layer = make_layer("negated_torch")
    assert layer.backend == "negated_torch" and layer.resolution.rule == "explicit request"
    # a class-wide counter: other tests prepare toy layers too
    count = NegatedTorchRunner.prepared_count
    layer.prepare_weights()
    # I = 24 padded to 32
    assert NegatedTorchRunner.prepared_count == count + 1 and layer.down_proj.shape[2] == 32
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    expected = make_layer("torch")
    with torch.no_grad():
        assert_close(layer(x), -expected(x), torch.float32)
    with pytest.raises(ValueError, match="already registered"):
        register_backend(toy_backend)


def test_a_registered_backend_is_checked_like_the_others(monkeypatch):
    monkeypatch.setitem(SPECS, "gpu_only_toy",
                        replace(SPECS[ExpertBackend.TORCH], backend="gpu_only_toy", on_cpu=None))
    with pytest.raises(ValueError,
                       match="backend='gpu_only_toy' cannot run on CPU.*needs a CUDA GPU"):
        FusedMoE(E, K, H, I, placement=Placement("gpu_only_toy", platform=Platform("cpu")))


def test_bad_construction_names_the_argument():
    with pytest.raises(ValueError, match="top_k=3"):
        FusedMoE(E, 3, H, I, routing=RoutingSpec(2))
    with pytest.raises(ValueError, match="top_k=9"):
        FusedMoE(E, 9, H, I)
    with pytest.raises(ValueError, match="backend='cuda' is not a backend"):
        FusedMoE(E, K, H, I, placement=Placement("cuda"))


def test_shared_experts_of_the_wrong_width_are_named():
    layer = make_layer("torch", shared=torch.nn.Linear(H, H + 1))
    with torch.no_grad(), pytest.raises(ValueError,
                                        match=r"shared_experts returned \(3, 33\) .* \(3, 32\)"):
        layer(torch.randn(3, H))


def test_the_runner_holds_the_layers_activation_and_routing():
    layer = make_layer()
    assert layer.runner.activation is SILU_AND_MUL and layer.runner.routing is layer.routing


def test_from_spec_builds_the_layer_its_spec_describes():
    routing = RoutingSpec(K, Scoring.SIGMOID, renormalize=True, correction_bias=True)
    spec = MoESpec(E, H, I, routing, Activation(ActivationKind.RELU2),
                   shared_combination=SharedCombination.AVERAGE)
    layer = FusedMoE.from_spec(spec, Placement("torch"), shared_experts=torch.nn.Linear(H, H))
    assert (layer.routing, layer.activation) == (routing, spec.activation)
    assert layer.shared_combination is SharedCombination.AVERAGE
    assert layer.gate_weight.shape == (E, H) and layer.gate_up_proj.shape == (E, I, H)  # relu^2: up
    assert layer.e_score_correction_bias.shape == (E,)
    assert isinstance(layer.shared_experts, torch.nn.Linear)


@pytest.mark.parametrize("quant_config,expected", [
    (None, NATIVE),
    (DEEPSEEK_FP8, WeightFormat.fp8_block(128, 128)),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, WeightFormat.fp8_tensor(static_input=True)),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, NATIVE),  # FlashInfer quantizes bf16 ones
], ids=["unquantized", "fp8-block", "modelopt-fp8", "nvfp4"])
def test_the_experts_format_is_the_models_unless_given(quant_config, expected):
    placement = Placement("torch", ModelContext(quant_config=quant_config))
    layer = FusedMoE(E, K, 128, 128, placement=placement, dtype=torch.bfloat16, device="meta")
    assert layer.weight_format == expected
    assert (layer.gate_up_proj.dtype == FP8_DTYPE) == (expected.fp8 is not None)
    given = FusedMoE(E, K, 128, 128, weight_format=NATIVE, placement=placement,
                     dtype=torch.bfloat16, device="meta")
    assert given.weight_format == NATIVE and given.gate_up_proj.dtype == torch.bfloat16


# ---- gradients: every backend differentiable, and in agreement -----------------------------------

def layer_grads(layer: FusedMoE, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """d(output . grad_out) for the input and every parameter (None where a parameter gets none)."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    layer(x).backward(grad_out)
    return {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("variant",
                         ["plain", "shared-average", "biased-sigmoid-scaled", "logits-softmax"])
def test_layer_gradients_match_the_torch_backend(variant):
    """The linear loss keeps the comparison to the backward: triton's forward rounds differently."""
    kwargs = {"plain": dict,
              "shared-average": lambda: dict(shared=torch.nn.Linear(H, H), combination="average"),
              "biased-sigmoid-scaled": lambda: dict(
                  routing=RoutingSpec(K, Scoring.SIGMOID, renormalize=True,
                                      routed_scaling_factor=2.5, correction_bias=True)),
              "logits-softmax": lambda: dict(
                  routing=RoutingSpec(K, select_on=SelectOn.LOGITS))}[variant]
    g = torch.Generator().manual_seed(4)
    x, grad_out = torch.randn(2, 5, H, generator=g), torch.randn(2, 5, H, generator=g)
    grads = {backend: layer_grads(make_layer(backend, **kwargs()), x, grad_out)
             for backend in ("triton", "torch")}
    assert grads["triton"].keys() == grads["torch"].keys()
    for name, expected in grads["torch"].items():
        assert expected is not None and grads["triton"][name] is not None, name
        assert_close(grads["triton"][name], expected, torch.float32, scale=2)


def test_fp8_layer_gradients_match_the_torch_backend():
    """FP8 experts: straight-through on both backends (the input, the router), none for e4m3 or
    scales."""
    fmt = WeightFormat.fp8_block(32, 32)
    layers = []
    for backend in ("triton", "torch"):
        layer = FusedMoE(E, K, 64, 32, weight_format=fmt, placement=Placement(backend),
                         dtype=torch.float16)
        g = torch.Generator().manual_seed(5)
        experts = ExpertWeights(torch.randn(E, 64, 64, generator=g) / 8,
                                torch.randn(E, 64, 32, generator=g) / 6
                                ).to_format(fmt)
        with torch.no_grad():
            layer.gate_weight.copy_(torch.randn(E, 64, generator=g) / 8)
            for name, field in (("gate_up_proj", "w13"), ("down_proj", "w2"),
                                ("gate_up_proj_scale", "w13_scale"),
                                ("down_proj_scale", "w2_scale")):
                getattr(layer, name).copy_(getattr(experts, field))
        layers.append(layer)
    g = torch.Generator().manual_seed(6)
    x, grad_out = torch.randn(7, 64, generator=g).half(), torch.randn(7, 64, generator=g).half()
    ours, expected = (layer_grads(layer, x, grad_out) for layer in layers)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
        assert ours[name] is None and expected[name] is None, name
    for name in ("x", "gate_weight"):
        assert_close(ours[name], expected[name], torch.float16, scale=2)


@pytest.mark.gpu
def test_layer_gradients_bf16_at_a_real_size_match_the_torch_backend():
    """E=64 K=8 H=1024 I=512, 512 tokens, bf16. The router runs in float32 (router_in_float32) so
    that both backends pick the same experts (bf16 logits tie often at this size). Both backends
    compute the backward in float32 from the same bf16 values and round each gradient once to
    bf16."""
    routing = RoutingSpec(8, renormalize=True, router_in_float32=True)
    grads = {}
    for backend in ("triton", "torch"):
        layer = FusedMoE(64, 8, 1024, 512, routing=routing, placement=Placement(backend),
                         dtype=torch.bfloat16, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") / p.shape[-1] ** 0.5)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(512, 1024, generator=g, device="cuda").bfloat16()
        grads[backend] = layer_grads(layer, x,
                                     torch.randn(512, 1024, generator=g, device="cuda").bfloat16())
    for name, expected in grads["torch"].items():
        error = relative_error(grads["triton"][name], expected)
        assert error < 1e-2, (name, error)
