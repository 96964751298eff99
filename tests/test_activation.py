"""activation: the standalone kernel against activation_torch, every kind, awkward widths; the
hand-written gradient against autograd through activation_torch."""
import pytest
import torch
from helpers import assert_close

from moe_triton.activation import (
    Activation,
    ActivationKind,
    activate,
    activation_backward_torch,
    activation_torch,
)

KINDS = [
    Activation(ActivationKind.SILU_AND_MUL),
    Activation(ActivationKind.GELU_AND_MUL),
    Activation(ActivationKind.GELU_TANH_AND_MUL),
    Activation(ActivationKind.RELU2),
    # limit inside the data range
    Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=1.5, swiglu_alpha=1.702),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("I", [1, 33, 961])
@pytest.mark.parametrize("M", [0, 1, 17])
@pytest.mark.parametrize("activation", KINDS, ids=lambda a: a.kind.name)
def test_activate(activation, M, I, dtype, poisoned_empty):
    torch.manual_seed(M * 1000 + I)
    x = (torch.randn(M, 2 * I if activation.gated else I) * 3).to(dtype)
    assert_close(activate(x, activation), activation_torch(x, activation), dtype)


@pytest.mark.parametrize("activation", KINDS, ids=lambda a: a.kind.name)
def test_activation_backward(activation):
    g = torch.Generator().manual_seed(activation.kind.value)
    # clamps hit
    x = (torch.randn(33, 2 * 40 if activation.gated else 40, generator=g) * 3).requires_grad_()
    grad = torch.randn(33, 40, generator=g)
    (expected,) = torch.autograd.grad(activation_torch(x, activation), x, grad)
    assert_close(activation_backward_torch(x.detach(), grad, activation), expected, torch.float32)


def test_clamped_swiglu_clamps():
    activation = Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=1.0, swiglu_alpha=1.0)
    x = torch.tensor([[5.0, -5.0]])  # gate 5 -> 1, up -5 -> -1: (up + 1) = 0
    assert activate(x, activation).item() == 0.0


def test_clamped_swiglu_is_gpt_oss_s_bit_for_bit_in_float32():
    """transformers' GptOssExperts._apply_gate on its interleaved [g0, u0, g1, u1, ...] columns,
    against the reference on the same values as [gate | up], bitwise (same ops, same order)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=2)
    experts = GptOssExperts(config)
    interleaved = torch.randn(37, 2 * 48, generator=torch.Generator().manual_seed(0)) * 6
    gate, up = interleaved[:, ::2], interleaved[:, 1::2]
    ours = activation_torch(torch.cat([gate, up], dim=1),
                            Activation(ActivationKind.CLAMPED_SWIGLU, config.swiglu_limit, 1.702))
    assert experts.alpha == 1.702 and torch.equal(ours, experts._apply_gate(interleaved))


def test_from_hidden_act():
    assert Activation.from_hidden_act("silu").kind is ActivationKind.SILU_AND_MUL
    assert not Activation.from_hidden_act("relu2").gated
    with pytest.raises(ValueError, match="hidden_act"):
        Activation.from_hidden_act("tanh")


@pytest.mark.parametrize("x,match", [
    (torch.randn(4, 7), "even"),
    (torch.randn(4), "gate_up"),
    (torch.randn(8, 4).T, "stride"),
])
def test_activate_rejects_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        activate(x)
