"""runners/padding.py: zero-padding I is exact, on the torch reference and on the Triton pipeline
(interpreter), for gated and non-gated experts; the multiple comes from the resolved backend."""
import pytest
import torch
from helpers import assert_close, random_expert_weights, random_ids

from moe_triton import (
    SILU_AND_MUL,
    Activation,
    ActivationKind,
    FusedMoE,
    Placement,
    fused_experts,
    fused_experts_torch,
    pad_experts,
)
from moe_triton.runners import SPECS, ExpertBackend, padded_size

RELU2 = Activation(ActivationKind.RELU2)
# I = 961 is NemotronH FP8's moe_intermediate_size 7688 at tensor-parallel 8.
SIZES = pytest.mark.parametrize("I", [961, 7688 // 8, 100], ids=["I961", "I7688/8", "I100"])
ACTIVATIONS = pytest.mark.parametrize("activation", [SILU_AND_MUL, RELU2],
                                      ids=["gated", "non-gated"])


def experts(E, H, I, activation, dtype=torch.float32, seed=0):
    return random_expert_weights(torch.Generator().manual_seed(seed), E, H, I, activation.gated,
                                 dtype)


def test_the_backend_owns_its_multiple():
    multiples = {backend: SPECS[backend].intermediate_multiple for backend in ExpertBackend}
    assert multiples == {ExpertBackend.TRITON: 1, ExpertBackend.TORCH: 1,
                         ExpertBackend.FLASHINFER_CUTLASS: 16,
                         ExpertBackend.FLASHINFER_TRTLLM: 128,
                         ExpertBackend.FLASHINFER_TRTLLM_ROUTED: 128}


def test_gated_halves_are_padded_separately():
    w13, w2 = experts(2, 8, 5, SILU_AND_MUL)
    p13, p2 = pad_experts(w13, w2, 16, gated=True)
    assert p13.shape == (2, 32, 8) and p2.shape == (2, 8, 16)
    # gate, then up at I'
    assert torch.equal(p13[:, :5], w13[:, :5]) and torch.equal(p13[:, 16:21], w13[:, 5:])
    assert not p13[:, 5:16].any() and not p13[:, 21:].any() and not p2[:, :, 5:].any()
    assert torch.equal(p2[:, :, :5], w2)


def test_non_gated_is_padded_directly():
    w13, w2 = experts(2, 8, 5, RELU2)
    p13, p2 = pad_experts(w13, w2, 128, gated=False)
    assert p13.shape == (2, 128, 8) and torch.equal(p13[:, :5], w13) and not p13[:, 5:].any()
    assert p2.shape == (2, 8, 128)


def test_aligned_experts_are_returned_as_they_are():
    w13, w2 = experts(2, 8, 32, SILU_AND_MUL)
    p13, p2 = pad_experts(w13, w2, 16, gated=True)
    assert p13 is w13 and p2 is w2


@SIZES
@ACTIVATIONS
@pytest.mark.parametrize("multiple", [16, 128])
def test_padding_is_exact_on_the_reference(I, activation, multiple):
    w13, w2 = experts(4, 24, I, activation)
    x, ids, weights = torch.randn(9, 24), random_ids(9, 2, 4, seed=I).int(), torch.rand(9, 2)
    p13, p2 = pad_experts(w13, w2, multiple, activation.gated)
    assert p2.shape[2] == padded_size(I, multiple)
    expected = fused_experts_torch(x, w13, w2, ids, weights, activation=activation)
    assert_close(fused_experts_torch(x, p13, p2, ids, weights, activation=activation), expected,
                 torch.float32)


@SIZES
@ACTIVATIONS
def test_padding_is_exact_on_triton(I, activation, poisoned_empty):
    w13, w2 = experts(4, 16, I, activation, torch.float16, seed=1)
    x, ids, weights = torch.randn(5, 16).half(), random_ids(5, 2, 4, seed=I).int(), torch.rand(5, 2)
    p13, p2 = pad_experts(w13, w2, 128, activation.gated)
    unpadded = fused_experts(x, w13, w2, ids, weights, activation=activation)
    padded = fused_experts(x, p13, p2, ids, weights, activation=activation)
    assert_close(padded, unpadded.float(), torch.float16)
    assert_close(padded, fused_experts_torch(x, w13, w2, ids, weights, activation=activation),
                 torch.float16, scale=2)


def test_layer_on_triton_keeps_shared_weights():
    layer = FusedMoE(4, 2, 16, 961, placement=Placement("triton"), device="cpu")
    w13, w2 = layer.gate_up_proj, layer.down_proj
    layer.prepare_weights()  # triton needs no multiple: nothing padded, nothing copied
    assert layer.gate_up_proj is w13 and layer.down_proj is w2


@pytest.mark.parametrize("bad,match", [
    (lambda: pad_experts(torch.zeros(2, 10, 8), torch.zeros(2, 8, 4), 16, gated=True),
     "expected \\(E, 8, H\\)"),
    (lambda: pad_experts(torch.zeros(2, 8), torch.zeros(2, 8, 4), 16, gated=True), "3-D"),
    (lambda: padded_size(10, 0), "multiple must be >= 1"),
])
def test_bad_input_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
