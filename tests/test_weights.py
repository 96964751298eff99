"""weights.py: ExpertWeights validates once, in every format; FP8 quantize -> dequantize round trips
against an independent float32 computation; padding keeps weights and scales consistent."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import copy_experts_

from moe_triton import ExpertWeights, Fp8Scaling, WeightFormat
from moe_triton.runners.padding import pad_expert_weights
from moe_triton.weights import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    per_tensor_rows,
    quantize_weight,
)

E, H, I = 3, 72, 61  # I not a multiple of any block: partial blocks at the edges
FORMATS = [WeightFormat.fp8_block(128, 128), WeightFormat.fp8_block(32, 16),
           WeightFormat.fp8_channel(),
           WeightFormat.fp8_tensor()]


def native(gated=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if gated else I
    # columns of very different size
    w13 = torch.randn(E, rows, H, generator=g) * torch.logspace(-2, 1, H)
    return ExpertWeights(w13, torch.randn(E, H, I, generator=g) / I**0.5, gated)


def block_amax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Independently of weights.py: the max |w| over each element's (rows x cols) block, per
    element."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[1], rows):
        for c in range(0, w.shape[2], cols):
            out[:, r:r + rows, c:c + cols] = w[:, r:r + rows, c:c + cols].abs().amax(dim=(1, 2),
                                                                                     keepdim=True)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("gated", [True, False])
def test_round_trip_is_within_half_an_fp8_step_of_its_scale_group(fmt, gated):
    """Each weight moves by at most 2^-4 of itself (3 mantissa bits, rounded to nearest) or, below
    the group's smallest normal (2^-6 * scale), by half the fixed 2^-9 * scale step."""
    weights = native(gated)
    quantized = weights.to_format(fmt)
    assert quantized.w13.dtype == FP8_DTYPE and quantized.format == fmt
    for original, back, halves in ((weights.w13, quantized.dequantized()[0], 2 if gated else 1),
                                    (weights.w2, quantized.dequantized()[1], 1)):
        if fmt.fp8 is Fp8Scaling.BLOCK:
            n, c = fmt.block
            amax = torch.cat([block_amax(part, n, c) for part in original.chunk(halves, dim=1)],
                             dim=1)
        elif fmt.fp8 is Fp8Scaling.CHANNEL:
            amax = original.abs().amax(dim=2, keepdim=True).expand_as(original)
        else:  # one scale per expert and projection: gate and up each their own
            amax = torch.cat([p.abs().amax(dim=(1, 2), keepdim=True).expand_as(p)
                              for p in original.chunk(halves, 1)], 1)
        scale = amax / FP8_MAX
        bound = torch.maximum(original.abs() * 2**-4, scale * 2**-10)
        assert ((back - original).abs() <= bound * (1 + 1e-5)).all()


def group_amax(w: torch.Tensor, fmt: WeightFormat, halves: int) -> torch.Tensor:
    """Per element, the max |w| of its scale group in `fmt` (NaN where the group holds one)."""
    if fmt.fp8 is Fp8Scaling.BLOCK:
        return torch.cat([block_amax(part, *fmt.block) for part in w.chunk(halves, dim=1)], dim=1)
    if fmt.fp8 is Fp8Scaling.CHANNEL:
        return w.abs().amax(dim=2, keepdim=True).expand_as(w)
    return torch.cat([p.abs().amax(dim=(1, 2), keepdim=True).expand_as(p)
                      for p in w.chunk(halves, 1)], 1)


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
    assert torch.equal(per_tensor_rows(torch.tensor([3.0, 5.0]), 2),
                       torch.tensor([[3.0, 3.0], [5.0, 5.0]]))


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
    # gate and up apart
    assert torch.equal(gate[:, :I], w13[:, :I]) and torch.equal(up[:, :I], w13[:, I:])
    assert (gate[:, I:] == 0).all() and (up[:, I:] == 0).all() and (p2[:, :, I:] == 0).all()
    assert torch.equal(p2[:, :, :I], w2)
    assert pad_expert_weights(padded, multiple) is padded


def scales_for(fmt, gated=True):
    rows = 2 * I if gated else I
    return (torch.ones(fmt.scale_shape(E, rows, H, 2 if gated else 1)),
            torch.ones(fmt.scale_shape(E, H, I)))


def fp8(*shape):
    return torch.zeros(shape, dtype=FP8_DTYPE)


@pytest.mark.parametrize("make,match", [
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_block(),
                           torch.ones(E, 1, 1), scales_for(WeightFormat.fp8_block())[1]),
     r"w13_scale must be a float32 tensor of shape \(3, 2, 1\)"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel(),
                           *(s.double() for s in scales_for(WeightFormat.fp8_channel()))),
     "w13_scale must be a float32"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), torch.zeros(E, H, I), True, WeightFormat.fp8_channel(),
                           *scales_for(WeightFormat.fp8_channel())),
     "w2 is torch.float32.*mixed formats"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel()),
     "w13_scale"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I)), "unquantized expert weights.*fp8"),
    (lambda: ExpertWeights(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I), w13_scale=torch.ones(1)),
     "scales were given"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True,
                           WeightFormat.fp8_tensor(static_input=True),
                           *scales_for(WeightFormat.fp8_tensor())), "input_scale"),
    (lambda: ExpertWeights(fp8(E, 2 * I, H), fp8(E, H, I), True, WeightFormat.fp8_channel(),
                           *scales_for(WeightFormat.fp8_channel()), torch.ones(1)),
     "input_scale was given"),
    (lambda: WeightFormat.fp8_block(128, 100), "block_c a power of two"),
    (lambda: WeightFormat(Fp8Scaling.CHANNEL, (128, 128)), "block"),
    (lambda: WeightFormat(Fp8Scaling.CHANNEL, static_input=True), "static_input"),
    (lambda: native().to_format(WeightFormat.fp8_tensor(static_input=True)), "calibration"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_weights_name_the_tensor(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---- the format's geometry: experts, slices and padding of I, checkpoint layouts --------------
# References slice / pad the dequantized float32 weights with torch, gate and up apart; the
# methods' results must dequantize to them exactly (each weight keeps its e4m3 value and scale).

GEOMETRY_FORMATS = [WeightFormat(), *FORMATS, WeightFormat.fp8_tensor(static_input=True)]
GATED = pytest.mark.parametrize("gated", [True, False], ids=["gated", "non-gated"])


def experts_in(fmt, gated=True, seed=0):
    weights = native(gated, seed)
    if fmt.fp8 is None:
        return weights
    q = weights.to_format(WeightFormat.fp8_tensor() if fmt.static_input else fmt)
    return ExpertWeights(q.w13, q.w2, gated, fmt, q.w13_scale, q.w2_scale,
                         torch.tensor([0.02]) if fmt.static_input else None)


def projections(w13, gated):
    return w13.chunk(2 if gated else 1, dim=1)  # (gate, up) or (up,)


def torch_narrow(w13, w2, gated, start, length, lead):
    cut = slice(start, start + length)
    parts = [F.pad(p[:, cut], (0, 0, lead, 0)) for p in projections(w13, gated)]
    return torch.cat(parts, dim=1), F.pad(w2[:, :, cut], (lead, 0))


def assert_same_experts(actual: ExpertWeights, w13, w2):
    a13, a2 = actual.dequantized()
    assert torch.equal(a13, w13) and torch.equal(a2, w2)


@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS, ids=str)
@GATED
@pytest.mark.parametrize("index", [slice(1, 3), torch.tensor([2, 0]), torch.tensor([]).int()],
                         ids=["slice", "tensor", "none"])
def test_select_experts_keeps_their_scales(fmt, gated, index):
    weights = experts_in(fmt, gated)
    if isinstance(index, torch.Tensor) and not index.numel():
        with pytest.raises(ValueError, match="E=0 experts"):
            weights.select_experts(index)
        return
    picked = weights.select_experts(index)
    w13, w2 = weights.dequantized()
    assert picked.format == fmt and picked.input_scale is weights.input_scale
    assert_same_experts(picked, w13[index], w2[index])


# (start, length): I = 61 ends inside a block of every block format
SLICES = [(0, 61), (0, 40), (32, 29), (32, 10), (40, 13), (5, 30), (60, 1)]


@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS, ids=str)
@GATED
@pytest.mark.parametrize("start,length", SLICES, ids=str)
def test_narrow_intermediate_is_the_slice_of_the_dequantized_weights(fmt, gated, start, length):
    """Behind grid_lead(start) zero columns, which put a slice that starts inside a block (of w13's
    rows, block_n, and of w2's columns, block_c, alike) back on the block grid."""
    weights = experts_in(fmt, gated)
    lead = fmt.grid_lead(start)
    assert lead == (start % math.lcm(*fmt.block) if fmt.block else 0)
    cut = weights.narrow_intermediate(start, length, lead)
    assert cut.intermediate_size == lead + length and cut.input_scale is weights.input_scale
    assert cut.w13.is_contiguous() and cut.w2.is_contiguous()
    assert cut.w13.data_ptr() != weights.w13.data_ptr()  # fresh: a shard owns its tensors
    assert_same_experts(cut, *torch_narrow(*weights.dequantized(), gated, start, length, lead))


@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS, ids=str)
def test_narrow_intermediate_with_a_lead_zeroes_real_columns(fmt):
    """A lead over columns that hold weights (48 of them, from column 0): they become zeros, gate
    and up apart."""
    weights = experts_in(fmt)
    cut = weights.narrow_intermediate(48, 13, lead=48)
    assert_same_experts(cut, *torch_narrow(*weights.dequantized(), True, 48, 13, 48))


@pytest.mark.parametrize("start,length,lead,match", [
    (40, 13, 0, r"starts at column 40, inside a \(32, 16\) block.*grid_lead\(start\) \(here 8\)"),
    (33, 10, 0, "inside a"),
    (0, 62, 0, "must lie in I=61"),
    (0, 0, 0, "length >= 1"),
    (4, 10, 8, "start - lead >= 0"),
    (8, 10, -1, "lead >= 0"),
])
def test_narrow_intermediate_refuses_off_grid_or_out_of_range(start, length, lead, match):
    weights = experts_in(WeightFormat.fp8_block(32, 16))
    with pytest.raises(ValueError, match=match):
        weights.narrow_intermediate(start, length, lead)


@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS, ids=str)
@GATED
@pytest.mark.parametrize("multiple", [16, 128, 61])
def test_pad_intermediate_is_the_zero_padded_dequantized_weights(fmt, gated, multiple):
    weights = experts_in(fmt, gated)
    padded = weights.pad_intermediate(multiple)
    if multiple == 61:
        assert padded is weights
        return
    extra = -I % multiple
    w13, w2 = weights.dequantized()
    expected = torch.cat([F.pad(p, (0, 0, 0, extra)) for p in projections(w13, gated)], dim=1)
    assert_same_experts(padded, expected, F.pad(w2, (0, extra)))
    if fmt.fp8 is not None:  # the new scale entries are 1: they multiply zeros only
        old = weights.w13_scale.shape[1] // len(projections(w13, gated))
        assert all((p[:, old:] == 1).all() for p in projections(padded.w13_scale, gated))
        old, s2 = weights.w2_scale.shape[-1], padded.w2_scale
        assert (s2[..., old:] == 1).all() and torch.equal(s2[..., :old], weights.w2_scale)


def test_pad_intermediate_refuses_a_bad_multiple():
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        experts_in(WeightFormat.fp8_channel()).pad_intermediate(0)


@pytest.mark.parametrize("bad,match", [(1, "got int"), (torch.tensor([0.0]), "1-D integer tensor"),
                                       (torch.tensor([0, 3]), r"\[0, 3\)")], ids=str)
def test_select_experts_refuses_what_is_not_an_index(bad, match):
    with pytest.raises(ValueError, match=match):
        experts_in(WeightFormat.fp8_channel()).select_experts(bad)


# ---- checkpoint layouts -> ExpertWeights ---------------------------------------------------------

def stored_projection(w: torch.Tensor, fmt: WeightFormat, style: int):
    """A stack of per-expert linears [E, N, C] as a checkpoint stores them: e4m3 and each expert's
    scale in one of the shapes published checkpoints use (`style` picks among them)."""
    q, scales = zip(*(quantize_weight(e, fmt) for e in w), strict=True)
    scale = torch.stack(scales)  # [E, Nb, Cb] block, [E, N] per row, [E, 1] per tensor
    if fmt.fp8 is Fp8Scaling.CHANNEL and style:
        scale = scale[..., None]  # [E, N, 1], compressed-tensors' channel scale
    elif fmt.fp8 is Fp8Scaling.TENSOR:
        scale = (scale[:, 0], scale, scale[..., None])[style]  # [E] (stacked ()), [E, 1], [E, 1, 1]
    return torch.stack(q), scale


def dequantize_stored(q: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """The published definition, q * scale, the scale broadcast over its tensor, row or block."""
    E, N, C = q.shape
    if fmt.block is not None:
        bn, bc = fmt.block
        scale = scale.repeat_interleave(bn, 1)[:, :N].repeat_interleave(bc, 2)[:, :, :C]
    else:
        scale = scale.reshape(E, -1, 1)
    return q.float() * scale


@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS[1:], ids=str)
@GATED
@pytest.mark.parametrize("style", [0, 1, 2])
def test_from_checkpoint_holds_what_the_checkpoint_s_tensors_stand_for(fmt, gated, style):
    weights = native(gated)
    dynamic = WeightFormat.fp8_tensor() if fmt.static_input else fmt
    first = [stored_projection(p, dynamic, style) for p in projections(weights.w13, gated)]
    (q13, s13), down = zip(*first, strict=True), stored_projection(weights.w2, dynamic, style)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.rand(E, generator=g) / 100 for _ in first]  # gate's and up's, per expert
    experts = ExpertWeights.from_checkpoint(q13, down[0], fmt, s13, down[1], inputs, gated=gated)
    assert experts.format == fmt and experts.gated == gated
    expected = torch.cat([dequantize_stored(q, s, fmt) for q, s in first], dim=1)
    assert_same_experts(experts, expected, dequantize_stored(*down, fmt))
    if fmt.static_input:  # one for every expert's gate and up input: the largest
        assert experts.input_scale.item() == max(t.max().item() for t in inputs)
    else:
        assert experts.input_scale is None
    if gated and fmt.block is not None and I % fmt.block[0]:
        return  # one block grid over [gate; up] cannot be split here: see below
    per_tensor = fmt.fp8 is Fp8Scaling.TENSOR
    fused = torch.cat([s.reshape(E, -1) if per_tensor else s for s in s13], dim=1)  # [gate; up]'s
    again = ExpertWeights.from_checkpoint(experts.w13, down[0], fmt, fused, down[1], inputs, gated)
    assert_same_experts(again, expected, dequantize_stored(*down, fmt))


def test_from_checkpoint_splits_a_fused_block_grid_only_on_its_block_rows():
    """I = 64 with 32-row blocks: the grid over [gate; up] is the gate grid then the up grid. I = 61
    (a block row holding gate and up rows under one scale) is refused."""
    fmt, g = WeightFormat.fp8_block(32, 16), torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(E, 128, H, generator=g), torch.randn(E, H, 64, generator=g)
    (q13, s13), (q2, s2) = stored_projection(w13, fmt, 0), stored_projection(w2, fmt, 0)
    experts = ExpertWeights.from_checkpoint(q13, q2, fmt, s13, s2)
    assert_same_experts(experts, dequantize_stored(q13, s13, fmt), dequantize_stored(q2, s2, fmt))
    odd = native().to_format(fmt)
    with pytest.raises(ValueError, match=r"one scale grid over the concatenated \[gate; up\] "
                                         r"rows, but I=61 is not a multiple of block_n=32, so "
                                         "block row 1 holds gate and up rows"):
        ExpertWeights.from_checkpoint(odd.w13, odd.w2, fmt, odd.w13_scale[:, 1:], odd.w2_scale)


def from_checkpoint(q, fmt=None, w13_scale=None, w2_scale=None, w13=None):
    """ExpertWeights.from_checkpoint on the FP8 experts `q`, with what is given instead."""
    return ExpertWeights.from_checkpoint(q.w13 if w13 is None else w13, q.w2, fmt or q.format,
                                         q.w13_scale if w13_scale is None else w13_scale,
                                         q.w2_scale if w2_scale is None else w2_scale)


@pytest.mark.parametrize("make,match", [
    (lambda q: from_checkpoint(q, w13_scale=[q.w13_scale[:, :2], q.w13_scale[:, 2:3]]),
     r"give \(3, 3, 5\); fp8 e4m3, 32x16 block scales.* need \(3, 4, 5\)"),
    (lambda q: from_checkpoint(q, w13_scale=q.w13_scale.int()), "float tensors"),
    (lambda q: from_checkpoint(q, w13_scale=[None]), "float tensors"),
    (lambda q: from_checkpoint(q, WeightFormat.fp8_tensor(static_input=True), torch.ones(E),
                               torch.ones(E)), "need their input scales"),
    (lambda q: from_checkpoint(q, WeightFormat.fp8_tensor(), torch.ones(E, 3), torch.ones(E)),
     r"per-tensor scales of \(3, 3\)"),
    (lambda q: from_checkpoint(q, w13=[q.w13[:, :3], q.w13[:, 3:]]), "tensors of one shape"),
    (lambda q: ExpertWeights.from_checkpoint(q.w13.float(), q.w2.float(), WeightFormat(),
                                             q.w13_scale), "scales were given for unquantized"),
], ids=["misshapen", "int-scale", "missing-scale", "missing-input-scale", "per-tensor-3",
        "uneven-stacks", "unquantized-with-scales"])
def test_from_checkpoint_names_what_is_wrong(make, match):
    with pytest.raises(ValueError, match=match):
        make(native().to_format(WeightFormat.fp8_block(32, 16)))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dequantize_weight_inverts_quantize_weight_s_layout(fmt):
    q, scale = quantize_weight(native().w13[0], fmt)  # [2I, H]
    expected = dequantize_stored(q[None], scale[None], fmt)[0]
    assert torch.equal(dequantize_weight(q, scale, fmt), expected)


def cuda_experts(weights: ExpertWeights) -> ExpertWeights:
    tensors = [getattr(weights, n) for n in ("w13", "w2", "w13_scale", "w2_scale", "input_scale")]
    moved = [t.cuda() if t is not None else None for t in tensors]
    return ExpertWeights(*moved[:2], weights.gated, weights.format, *moved[2:])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GEOMETRY_FORMATS, ids=str)
@GATED
def test_the_geometry_on_the_gpu_gives_the_cpu_s_tensors(fmt, gated):
    """e4m3 on CUDA: the copies, zeroed leads and padding give the bytes the CPU gives."""
    weights = experts_in(fmt, gated)
    on_gpu = cuda_experts(weights)
    lead = fmt.grid_lead(40)
    for method in (lambda w: w.select_experts(torch.tensor([2, 0], device=w.device)),
                   lambda w: w.narrow_intermediate(40, 13, lead),
                   lambda w: w.narrow_intermediate(48, 13, 48), lambda w: w.pad_intermediate(128)):
        expected, actual = method(weights), method(on_gpu)
        assert actual.device.type == "cuda"
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            a, e = getattr(actual, name), getattr(expected, name)
            assert (a is None) == (e is None), name
            if a is not None:
                assert a.cpu().view(torch.uint8).equal(e.view(torch.uint8)), name


# ---- MXFP4 (issue 31): the format, its round trip and its rounding rule --------------------------

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_mxfp4_round_trip_is_within_half_an_e2m1_step_of_its_group():
    """Each group of 32 scales by 2^e with max |w| / 2^e <= 6: every value within half the gap
    between its two e2m1 neighbours (1 at the top, between 4 and 6), times the scale."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(3, 2 * 64, 96, generator=g), torch.randn(3, 96, 64, generator=g)
    q = ExpertWeights(w13, w2).to_format(WeightFormat.mxfp4())
    assert (q.w13.dtype, q.w13.shape, q.w13_scale.shape) == (torch.uint8, (3, 128, 48), (3, 128, 3))
    assert (q.w2.shape, q.w2_scale.shape) == ((3, 96, 32), (3, 96, 2))
    assert (q.hidden_size, q.intermediate_size) == (96, 64)
    for w, back, scale in ((w13, q.dequantized()[0], q.w13_scale),
                           (w2, q.dequantized()[1], q.w2_scale)):
        step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
        assert ((back - w).abs() <= step + 1e-7).all()  # half of the widest gap (2), scaled
        assert (w.abs().unflatten(-1, (-1, 32)).amax(-1)
                <= 6 * torch.exp2(scale.float() - 127)).all()  # nothing saturates


def test_mxfp4_holds_e2m1_values_exactly_and_rounds_ties_to_the_even_code():
    from moe_triton.weights import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(1)
    signs = torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    exact = E2M1_GRID[torch.randint(0, 8, (4, 64), generator=g)] * signs
    exact[:, ::32] = 6.0  # each group's max 6: its scale is 2^0
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact * 2.0**-3)), exact * 2.0**-3)
    # midpoints between neighbours, in a group scaled by 1: ties go to the even code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0] * 4)
    packed, scales = quantize_mxfp4(ties)
    assert scales.tolist() == [127] and torch.equal(dequantize_mxfp4(packed, scales), expected)
    assert packed[0].item() == 0x20  # 0.25 -> code 0 in the low nibble, 0.75 -> code 2 in the high


def test_mxfp4_scale_255_is_nan_and_a_zero_group_is_zero():
    from moe_triton.weights import dequantize_mxfp4, quantize_mxfp4

    packed, scales = quantize_mxfp4(torch.zeros(64))
    assert scales.tolist() == [0, 0] and torch.equal(dequantize_mxfp4(packed, scales),
                                                     torch.zeros(64))
    values = dequantize_mxfp4(packed, torch.tensor([255, 127], dtype=torch.uint8))
    assert values[:32].isnan().all() and torch.equal(values[32:], torch.zeros(32))


def mxfp4_experts(**changes):
    q = ExpertWeights(torch.randn(2, 128, 64), torch.randn(2, 64, 64)).to_format(
        WeightFormat.mxfp4())
    fields = dict(w13=q.w13, w2=q.w2, gated=True, format=q.format, w13_scale=q.w13_scale,
                  w2_scale=q.w2_scale) | changes
    return ExpertWeights(**fields)


@pytest.mark.parametrize("changes,match", [
    (dict(w13_scale=torch.zeros(2, 128, 2)), "w13_scale must be a uint8 tensor of shape"),
    (dict(w2_scale=torch.zeros(2, 64, 3, dtype=torch.uint8)), "w2_scale must be a uint8"),
    (dict(w13=torch.zeros(2, 128, 64, dtype=torch.uint8)), r"to match w13 \(2, 128, 64\)"),
    (dict(w2=torch.zeros(2, 64, 64, dtype=torch.uint8)), r"w2 must have shape \(E, H, I / 2\)"),
    (dict(w13=torch.zeros(2, 128, 40, dtype=torch.uint8),
          w2=torch.zeros(2, 80, 32, dtype=torch.uint8),
          w2_scale=torch.zeros(2, 80, 2, dtype=torch.uint8)), "H=80 must be a multiple of 32"),
    (dict(input_scale=torch.ones(1)), "input_scale was given"),
], ids=["scale-dtype", "scale-shape", "w13-unpacked", "w2-unpacked", "H-off-group", "input"])
def test_bad_mxfp4_weights_name_the_tensor(changes, match):
    with pytest.raises(ValueError, match=match):
        mxfp4_experts(**changes)


def test_mxfp4_layer_runs_on_both_backends_as_the_dequantized_weights_do():
    """The layer on the Triton kernels (interpreted, float32) and on backend='torch' computes the
    dequantized weights' experts; auto picks the torch reference on a CPU, as for FP8."""
    from moe_triton import FusedMoE, Placement, RoutingSpec, fused_experts_torch, run_experts
    from moe_triton.routing import route_torch

    weights = mxfp4_experts()
    auto = FusedMoE(2, 1, 64, 64, routing=RoutingSpec(1), weight_format=WeightFormat.mxfp4())
    assert auto.backend == "torch" and "mxfp4" in auto.resolution.reason
    x = torch.randn(5, 64)
    for placement in ("torch", "triton"):
        layer = FusedMoE(2, 1, 64, 64, routing=RoutingSpec(1), weight_format=WeightFormat.mxfp4(),
                         placement=Placement(placement))
        assert layer.gate_up_proj.dtype == torch.uint8 and not layer.gate_up_proj.requires_grad
        copy_experts_(layer, weights)
        with torch.no_grad():
            layer.gate_weight.copy_(torch.arange(128.0).reshape(2, 64).cos())
        ids, topk_weights = route_torch(x @ layer.gate_weight.T, layer.routing)
        expected = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights)
        # float32 both ways: sums rounded in another order, relative to the largest output
        atol = 1e-6 * expected.abs().max().item()
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=atol)
    torch.testing.assert_close(run_experts(x, weights, ids, topk_weights), expected, rtol=1e-5,
                               atol=atol)


def test_mxfp4_pads_and_narrows_on_whole_groups_as_the_dequantized_weights_do():
    q = mxfp4_experts()  # I = 64
    w13, w2 = q.dequantized()
    padded = q.pad_intermediate(96)
    p13, p2 = padded.dequantized()
    assert padded.intermediate_size == 96 and torch.equal(p2[..., :64], w2)
    assert torch.equal(p2[..., 64:], torch.zeros(2, 64, 32))
    assert torch.equal(p13, torch.cat([F.pad(half, (0, 0, 0, 32)) for half in w13.chunk(2, 1)], 1))
    cut = q.narrow_intermediate(32, 32)
    c13, c2 = cut.dequantized()
    assert torch.equal(c2, w2[..., 32:]) and torch.equal(c13, torch.cat(
        [half[:, 32:] for half in w13.chunk(2, 1)], 1))
    with pytest.raises(ValueError, match="whole 32-column groups"):
        q.narrow_intermediate(16, 32)
    with pytest.raises(ValueError, match="whole 32-column groups"):
        q.pad_intermediate(40)


@pytest.mark.parametrize("fmt", [WeightFormat(), WeightFormat.fp8_channel(),
                                 WeightFormat.mxfp4()], ids=str)
def test_interleaved_gate_up_rows_are_reordered_once_with_their_scales(fmt):
    """gpt-oss stores w13's rows as [g0, u0, g1, u1, ...]: from_checkpoint(interleaved=True) holds
    the same experts as the [gate; up] layout built from the de-interleaved rows."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(2, 2 * 64, 64, generator=g), torch.randn(2, 64, 64, generator=g)
    stacked = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
    if not fmt.quantized:
        ours = ExpertWeights.from_checkpoint(w13, w2, fmt, interleaved=True)
        assert torch.equal(ours.w13, stacked)
        return
    # quantized as the checkpoint stored it: the interleaved rows, each with its own scales
    stored = ExpertWeights(w13, w2).to_format(fmt)
    ours = ExpertWeights.from_checkpoint(stored.w13, stored.w2, fmt, stored.w13_scale,
                                         stored.w2_scale, interleaved=True)
    dequantized = stored.dequantized()[0]
    assert torch.equal(ours.dequantized()[0],
                       torch.cat([dequantized[:, 0::2], dequantized[:, 1::2]], dim=1))


def test_interleaved_rows_refuse_block_scales_and_non_gated_experts():
    q = ExpertWeights(torch.randn(2, 256, 128), torch.randn(2, 128, 128)).to_format(
        WeightFormat.fp8_block())
    with pytest.raises(ValueError, match="block or per-tensor scale would cover gate and up"):
        ExpertWeights.from_checkpoint(q.w13, q.w2, q.format, q.w13_scale, q.w2_scale,
                                      interleaved=True)
    with pytest.raises(ValueError, match="gated=False"):
        ExpertWeights.from_checkpoint(torch.randn(2, 64, 64), torch.randn(2, 64, 64),
                                      WeightFormat(), gated=False, interleaved=True)
