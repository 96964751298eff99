"""weights.py: ExpertWeights validates once, in every format; FP8 quantize -> dequantize round trips
against an independent float32 computation; padding keeps weights and scales consistent."""
import pytest
import torch

from moe_triton import ExpertWeights, Fp8Scaling, WeightFormat
from moe_triton.runners.padding import pad_expert_weights
from moe_triton.weights import FP8_DTYPE, FP8_MAX, per_tensor_rows

E, H, I = 3, 72, 61  # I not a multiple of any block: partial blocks at the edges
FORMATS = [WeightFormat.fp8_block(128, 128), WeightFormat.fp8_block(32, 16), WeightFormat.fp8_channel(),
           WeightFormat.fp8_tensor()]


def native(gated=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if gated else I
    w13 = torch.randn(E, rows, H, generator=g) * torch.logspace(-2, 1, H)  # columns of very different size
    return ExpertWeights(w13, torch.randn(E, H, I, generator=g) / I**0.5, gated)


def block_amax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Independently of weights.py: the max |w| over each element's (rows x cols) block, per element."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[1], rows):
        for c in range(0, w.shape[2], cols):
            out[:, r:r + rows, c:c + cols] = w[:, r:r + rows, c:c + cols].abs().amax(dim=(1, 2), keepdim=True)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("gated", [True, False])
def test_round_trip_is_within_half_an_fp8_step_of_its_scale_group(fmt, gated):
    """Each weight moves by at most 2^-4 of itself (3 mantissa bits, rounded to nearest) or, below the
    group's smallest normal (2^-6 * scale), by half the fixed 2^-9 * scale step."""
    weights = native(gated)
    quantized = weights.to_format(fmt)
    assert quantized.w13.dtype == FP8_DTYPE and quantized.format == fmt
    for original, back, halves in ((weights.w13, quantized.dequantized()[0], 2 if gated else 1),
                                    (weights.w2, quantized.dequantized()[1], 1)):
        if fmt.fp8 is Fp8Scaling.BLOCK:
            n, c = fmt.block
            amax = torch.cat([block_amax(part, n, c) for part in original.chunk(halves, dim=1)], dim=1)
        elif fmt.fp8 is Fp8Scaling.CHANNEL:
            amax = original.abs().amax(dim=2, keepdim=True).expand_as(original)
        else:  # one scale per expert and projection: gate and up each their own
            amax = torch.cat([p.abs().amax(dim=(1, 2), keepdim=True).expand_as(p) for p in original.chunk(halves, 1)], 1)
        scale = amax / FP8_MAX
        bound = torch.maximum(original.abs() * 2**-4, scale * 2**-10)
        assert ((back - original).abs() <= bound * (1 + 1e-5)).all()


def group_amax(w: torch.Tensor, fmt: WeightFormat, halves: int) -> torch.Tensor:
    """Per element, the max |w| of its scale group in `fmt` (NaN where the group holds one)."""
    if fmt.fp8 is Fp8Scaling.BLOCK:
        return torch.cat([block_amax(part, *fmt.block) for part in w.chunk(halves, dim=1)], dim=1)
    if fmt.fp8 is Fp8Scaling.CHANNEL:
        return w.abs().amax(dim=2, keepdim=True).expand_as(w)
    return torch.cat([p.abs().amax(dim=(1, 2), keepdim=True).expand_as(p) for p in w.chunk(halves, 1)], 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_nan_weight_quantizes_its_scale_group_to_nan(fmt):
    """Issue 25 item 2, the torch side: a NaN weight makes its block's, row's or tensor's scale NaN
    and that group dequantize to NaN (torch's amax, clamp and e4m3 cast keep NaN: e4m3fn's 0x7f);
    every other weight quantizes as without it."""
    weights = native()
    w13 = weights.w13.clone()
    w13[1, 2 * I - 3, 40] = float("nan")  # in the up half
    poisoned = ExpertWeights(w13, weights.w2, True).to_format(fmt).dequantized()[0]
    expected = group_amax(w13, fmt, 2).isnan()
    assert expected.any() and not expected[0].any() and torch.equal(poisoned.isnan(), expected)
    assert torch.equal(poisoned[~expected], weights.to_format(fmt).dequantized()[0][~expected])


def test_gate_and_up_keep_their_own_per_tensor_scales_exactly():
    scales = torch.tensor([[0.5, 2.0], [1.0, 4.0]])  # [E, 2]: gate, up
    rows = per_tensor_rows(scales, 6)
    assert torch.equal(rows, torch.tensor([[0.5] * 3 + [2.0] * 3, [1.0] * 3 + [4.0] * 3]))
    assert torch.equal(per_tensor_rows(torch.tensor([3.0, 5.0]), 2), torch.tensor([[3.0, 3.0], [5.0, 5.0]]))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("multiple", [16, 128])
def test_padding_pads_weights_and_scales_consistently(fmt, multiple):
    weights = native().to_format(fmt)
    padded = pad_expert_weights(weights, multiple)
    I_padded = -(-I // multiple) * multiple
    assert padded.intermediate_size == I_padded
    w13, w2 = weights.dequantized()
    p13, p2 = padded.dequantized()
    gate, up = p13.chunk(2, dim=1)
    assert torch.equal(gate[:, :I], w13[:, :I]) and torch.equal(up[:, :I], w13[:, I:])  # gate and up apart
    assert (gate[:, I:] == 0).all() and (up[:, I:] == 0).all() and (p2[:, :, I:] == 0).all()
    assert torch.equal(p2[:, :, :I], w2)
    assert pad_expert_weights(padded, multiple) is padded


def scales_for(fmt, gated=True):
    rows = 2 * I if gated else I
    return (torch.ones(fmt.scale_shape(E, rows, H, 2 if gated else 1)), torch.ones(fmt.scale_shape(E, H, I)))


def fp8(*shape):
    return torch.zeros(shape, dtype=FP8_DTYPE)


@pytest.mark.parametrize("make,match", [
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_block(), torch.ones(E, 1, 1),
                           scales_for(WeightFormat.fp8_block())[1]), r"w13_scale must be a float32 tensor of shape \(3, 2, 1\)"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel(),
                           *(s.double() for s in scales_for(WeightFormat.fp8_channel()))), "w13_scale must be a float32"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), torch.zeros(E, H, I), True, WeightFormat.fp8_channel(),
                           *scales_for(WeightFormat.fp8_channel())), "w2 is torch.float32.*mixed formats"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel()), "w13_scale"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I)), "unquantized expert weights.*fp8"),
    (lambda: ExpertWeights(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I), w13_scale=torch.ones(1)), "scales were given"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_tensor(static_input=True),
                           *scales_for(WeightFormat.fp8_tensor())), "input_scale"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel(),
                           *scales_for(WeightFormat.fp8_channel()), torch.ones(1)), "input_scale was given"),
    (lambda: WeightFormat.fp8_block(128, 100), "block_c a power of two"),
    (lambda: WeightFormat(Fp8Scaling.CHANNEL, (128, 128)), "block"),
    (lambda: WeightFormat(Fp8Scaling.CHANNEL, static_input=True), "static_input"),
    (lambda: native().to_format(WeightFormat.fp8_tensor(static_input=True)), "calibration"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_weights_name_the_tensor(make, match):
    with pytest.raises(ValueError, match=match):
        make()
