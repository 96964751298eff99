"""runners/flashinfer.py: every argument and the weight preparation, against checkers that stand in
for FlashInfer's entry points with the signatures flashinfer-python 0.7.2.post1 publishes
(tests/fake_flashinfer.py). These paths are unverified on hardware: see the module docstring."""
import sys

import fake_flashinfer
import pytest
import torch
from helpers import assert_close

from moe_triton import (
    SILU_AND_MUL,
    Activation,
    ActivationKind,
    FusedMoE,
    ModelContext,
    Placement,
    RoutingSpec,
    Scoring,
    SelectOn,
)
from moe_triton.platform import Platform
from moe_triton.quant_config import QuantFormat
from moe_triton.runners.flashinfer import import_flashinfer, prepare_experts, up_gate

SM100 = Platform("cuda", (10, 0), "0.7.2.post1")
SM90 = Platform("cuda", (9, 0), "0.7.2.post1")
RELU2 = Activation(ActivationKind.RELU2)
NVFP4 = ModelContext(quant_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
FUSED, ROUTED, CUTLASS = "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass"


@pytest.fixture
def calls(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


def make_layer(backend, *, platform=SM100, routing=RoutingSpec(2, renormalize=True),
               activation=SILU_AND_MUL,
               I=96, H=128, E=8, context=ModelContext(), seed=0):
    layer = FusedMoE(E, routing.top_k, H, I, routing=routing, activation=activation,
                     placement=Placement(backend, context, platform=platform), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.gate_weight, layer.gate_up_proj, layer.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if routing.correction_bias:
            layer.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.5)
    return layer


def check_against_torch(layer, **kwargs):
    """`layer` (prepared) against the same weights on the torch reference backend."""
    reference = make_layer("torch", platform=Platform("cpu"), **kwargs)
    x = torch.randn(7, layer.gate_weight.shape[1],
                    generator=torch.Generator().manual_seed(9)).bfloat16()
    with torch.no_grad():
        assert_close(layer(x), reference(x).float(), torch.bfloat16)


def test_up_gate_swaps_the_halves_for_flashinfer():
    w13 = torch.arange(2 * 6 * 4.0).reshape(2, 6, 4)  # [E, 2I, H], [gate; up]
    swapped = up_gate(w13, SILU_AND_MUL)
    assert torch.equal(swapped[:, :3], w13[:, 3:]) and torch.equal(swapped[:, 3:], w13[:, :3])
    assert torch.equal(up_gate(w13, RELU2), w13)  # non-gated: one block, nothing to swap


@pytest.mark.parametrize("I", [96, 128, 200], ids=lambda i: f"I{i}")
@pytest.mark.parametrize("activation", [SILU_AND_MUL, RELU2], ids=lambda a: a.kind.name)
@pytest.mark.parametrize("backend,kernel,multiple", [
    (FUSED, "trtllm_bf16_moe", 128), (ROUTED, "trtllm_bf16_routed_moe", 128),
    (CUTLASS, "cutlass_fused_moe", 16)])
def test_layer_on_flashinfer_matches_torch(backend, kernel, multiple, activation, I, calls):
    layer = make_layer(backend, activation=activation, I=I)
    layer.prepare_weights()
    # padded per the resolved backend
    assert layer.down_proj.shape[2] == -(-I // multiple) * multiple
    assert layer.runner.prepared.intermediate_size == layer.down_proj.shape[2]
    check_against_torch(layer, activation=activation, I=I)
    assert [name for name, _ in calls] == [kernel]


@pytest.mark.parametrize("routing,method", [
    (RoutingSpec(2, Scoring.SOFTMAX), "Default"),
    (RoutingSpec(2, Scoring.SOFTMAX, renormalize=True), "Renormalize"),
    (RoutingSpec(2, Scoring.SOFTMAX, SelectOn.LOGITS), "Renormalize"),  # Cohere2 softmax
    # Cohere2 sigmoid
    (RoutingSpec(2, Scoring.SIGMOID, SelectOn.LOGITS, renormalize=True), "SigmoidRenorm"),
    (RoutingSpec(3, Scoring.SIGMOID), "Sigmoid"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_fused_router_computes_our_routing(routing, method, calls):
    layer = make_layer(FUSED, routing=routing)
    layer.prepare_weights()
    check_against_torch(layer, routing=routing)
    (name, kwargs), = calls
    assert kwargs["routing_method_type"] == fake_flashinfer.RoutingMethodType[method]
    assert (kwargs["norm_topk_prob"] == routing.renormalize
            and kwargs["routing_logits"].dtype == torch.float32)


def test_routed_path_takes_our_biased_sigmoid_topk(calls):
    minimax = dict(routing=RoutingSpec(2, Scoring.SIGMOID, renormalize=True, correction_bias=True))
    layer = make_layer(ROUTED, **minimax)
    layer.prepare_weights()
    check_against_torch(layer, **minimax)
    (name, kwargs), = calls
    ids, weights = kwargs["topk_ids"]
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32


@pytest.mark.parametrize("backend,kernel", [(FUSED, "trtllm_fp4_block_scale_moe"),
                                            (ROUTED, "trtllm_fp4_block_scale_routed_moe")])
@pytest.mark.parametrize("activation", [SILU_AND_MUL, RELU2], ids=lambda a: a.kind.name)
def test_nvfp4_experts_use_the_fp4_entry_points(backend, kernel, activation, calls):
    layer = make_layer(backend, activation=activation, context=NVFP4)
    layer.prepare_weights()
    assert layer.runner.prepared.quant is QuantFormat.NVFP4
    assert set(layer.runner.prepared.weights) >= {"gemm1_weights_scale", "gemm2_weights_scale",
                                                  "output2_scale_scalar"}
    check_against_torch(layer, activation=activation)  # the checker computes on the bf16 originals
    assert [name for name, _ in calls] == [kernel]


def test_cutlass_runs_on_sm90(calls):
    layer = make_layer(CUTLASS, platform=SM90, I=100)
    layer.prepare_weights()
    assert layer.down_proj.shape[2] == 112
    check_against_torch(layer, I=100)


def test_prepare_hands_flashinfer_up_then_gate():
    w13, w2 = torch.randn(4, 256, 128).bfloat16(), torch.randn(4, 128, 128).bfloat16()
    experts = prepare_experts("TrtllmBf16Config", w13, w2, SILU_AND_MUL, QuantFormat.NONE,
                              fake_flashinfer.modules())
    prepared = fake_flashinfer.PREPARED[id(experts.weights["gemm1_weights"])]
    assert torch.equal(prepared.w1, torch.cat([w13[:, 128:], w13[:, :128]], dim=1).float())
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (4, 128, 128)


def test_prepare_rejects_what_flashinfer_cannot_take():
    fi = fake_flashinfer.modules()
    with pytest.raises(ValueError, match="bfloat16"):
        prepare_experts("CutlassBf16Config", torch.randn(2, 32, 16), torch.randn(2, 16, 16),
                        SILU_AND_MUL,
                        QuantFormat.NONE, fi)
    with pytest.raises(ValueError, match="GELU_AND_MUL"):
        prepare_experts("CutlassBf16Config", torch.randn(2, 32, 16).bfloat16(),
                        torch.randn(2, 16, 16).bfloat16(), Activation(ActivationKind.GELU_AND_MUL),
                        QuantFormat.NONE, fi)


def test_forward_before_prepare_weights_fails_loudly(calls):
    layer = make_layer(ROUTED)
    with pytest.raises(RuntimeError, match="prepare_weights"):
        layer(torch.randn(3, 128).bfloat16())


def test_empty_batch_and_wrong_dtype(calls):
    layer = make_layer(CUTLASS)
    layer.prepare_weights()
    with torch.no_grad():  # inference: in grad mode the layer refuses (the next test)
        assert layer(torch.randn(0, 128).bfloat16()).shape == (0, 128)
        with pytest.raises(ValueError, match="bfloat16"):
            layer.runner.experts(torch.randn(3, 128), layer.expert_weights(),
                                 torch.zeros(3, 2, dtype=torch.int32),
                                 torch.ones(3, 2))
    assert calls == []


@pytest.mark.parametrize("backend", [FUSED, ROUTED, CUTLASS])
def test_gradients_are_refused_not_detached(backend, calls):
    """FlashInfer's kernels have no backward: grad mode with the layer's parameters requiring grad
    (their default) is a one-line ValueError before FlashInfer runs, also with frozen experts."""
    layer = make_layer(backend)
    layer.prepare_weights()
    x = torch.randn(3, 128).bfloat16()
    for frozen in (False, True):
        layer.gate_up_proj.requires_grad_(not frozen)
        layer.down_proj.requires_grad_(not frozen)
        with pytest.raises(ValueError, match=f"the {backend} backend has no backward") as refusal:
            layer(x)
        assert "\n" not in str(refusal.value)
    assert calls == []


def test_missing_flashinfer_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'moe-triton\[flashinfer\]'"):
        import_flashinfer()
    for backend in (FUSED, ROUTED, CUTLASS):
        with pytest.raises(ValueError, match=f"{backend}.*SM100.*FlashInfer is not installed"):
            make_layer(backend, platform=Platform("cuda", (10, 0), None))
