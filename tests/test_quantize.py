"""quantize.py: the FP8 activation quantization kernel against its torch reference, and the rounding
helper against torch's own float32 -> e4m3 cast (round to nearest even), under the interpreter
too."""
import pytest
import torch
import triton
import triton.language as tl
from helpers import test_device

from moe_triton.quantize import dequantize_fp8_torch, quantize_fp8, quantize_fp8_torch, round_to_fp8
from moe_triton.weights import FP8_DTYPE, FP8_MAX


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to_fp8(tl.minimum(tl.maximum(x, -448.0), 448.0)).to(tl.float8e4nv),
             mask=offs < n)


def test_round_to_fp8_matches_torchs_cast():
    # The interpreter's own cast got these wrong: a carry into the exponent (124.3 -> 128),
    # subnormals (0.001, 2^-10 .. 3 * 2^-10), ties (exactly half a step: 1.0625 -> 1.0, 1.1875 ->
    # 1.25), the top (464).
    edges = torch.tensor([124.3, 0.001, 2**-10, 3 * 2**-10, 2**-9 * 1.5, 1.0625, 1.1875, 447.9,
                          464.0, 0.0, -0.0,
                          -5.7, 300.0, 1e-9, -2**-7 * 1.0625])
    g = torch.Generator().manual_seed(0)
    x = torch.cat([edges, torch.randn(2000, generator=g) * 100,
                   torch.randn(2000, generator=g) * 1e-2]).to(test_device())
    y = torch.empty_like(x, dtype=FP8_DTYPE)
    _round_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(y.float(), expected.float())  # values: +0.0 and -0.0 compare equal


@pytest.mark.parametrize("T,C,group",
                         [(0, 16, 16), (1, 1, None), (3, 72, 32), (5, 961, 128), (7, 128, 128),
                          (4, 300, None), (2, 2500, 2048)], ids=str)
def test_quantize_matches_reference(T, C, group, poisoned_empty):
    g = torch.Generator().manual_seed(T + C)
    x = (torch.randn(T, C, generator=g)
         * torch.logspace(-3, 2, C)).to(torch.float16).to(test_device())
    q, scales = quantize_fp8(x, group)
    q_ref, scales_ref = quantize_fp8_torch(x, group)
    assert (q.dtype == FP8_DTYPE and scales.dtype == torch.float32
            and scales.shape == (T, -(-C // (group or C))))
    assert torch.equal(scales.cpu(), scales_ref.cpu())
    assert torch.equal(q.float().cpu(), q_ref.float().cpu())


@pytest.mark.parametrize("T,C,group", [(70, 128, 128), (37, 48, 16)], ids=str)
def test_blocks_of_rows_with_a_partial_last_one(T, C, group, monkeypatch):
    """Large batches stack rows into one program (up to 32 rows of 128 columns); with the program
    floor lowered, small shapes do too, in blocks that do not divide T."""
    from moe_triton import quantize

    monkeypatch.setattr(quantize, "MIN_PROGRAMS", 2)
    block_t = quantize.plan_quantize(torch.empty(T, C), group).launch.fixed["BLOCK_T"]
    assert block_t > 1 and T % block_t
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(T)).to(torch.float16)
    q, scales = quantize_fp8(x, group)
    q_ref, scales_ref = quantize_fp8_torch(x, group)
    assert torch.equal(scales, scales_ref) and torch.equal(q.float(), q_ref.float())


def test_static_scale_quantizes_with_the_given_scale():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(test_device())
    static = torch.tensor([0.01], device=x.device)
    q, scales = quantize_fp8(x, None, static)
    assert scales.shape == (6, 1) and scales.stride(0) == 0 and torch.equal(scales[3], static)
    assert torch.equal(q.float(), quantize_fp8_torch(x, None, static)[0].float())
    assert float(q.float().abs().max()) <= FP8_MAX  # values past 448 * scale saturate, never inf


@pytest.mark.parametrize("group", [None, 16, 64])
def test_round_trip_error_is_half_an_fp8_step(group):
    """e4m3 keeps 3 mantissa bits: rounding to nearest moves a value by at most 2^-4 of itself in
    the normal range; below the group's smallest normal (2^-6 * scale) the step is fixed at 2^-9 *
    scale."""
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(test_device())
    q, scales = quantize_fp8(x, group)
    back = dequantize_fp8_torch(q, scales, group)
    per_column = scales.repeat_interleave(group or 64, dim=1)
    bound = torch.maximum(x.abs() * 2**-4, per_column * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("group,static", [(None, False), (16, False), (32, False), (None, True)],
                         ids=str)
def test_nan_stays_in_its_scale_group(group, static):
    """A NaN makes its group's scale NaN and the group's values e4m3fn NaN, as torch's quantization
    does; a static scale stays, the NaN value alone becomes NaN. The other groups are untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 72, generator=g).half().to(test_device())
    x[1, 7] = x[3, 40] = x[3, 41] = float("nan")
    static_scale = torch.tensor([0.01], device=x.device) if static else None
    q, scales = quantize_fp8(x, group, static_scale)
    q_ref, scales_ref = quantize_fp8_torch(x, group, static_scale)
    assert scales.isnan().any() != static and torch.equal(scales.isnan().cpu(),
                                                          scales_ref.isnan().cpu())
    assert torch.equal(scales.nan_to_num().cpu(), scales_ref.nan_to_num().cpu())
    assert q.float().isnan().any() and torch.equal(q.float().isnan().cpu(),
                                                   q_ref.float().isnan().cpu())
    assert torch.equal(q.float().nan_to_num().cpu(), q_ref.float().nan_to_num().cpu())


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="x must be a 2-D float tensor"):
        quantize_fp8(torch.zeros(4))
    with pytest.raises(ValueError, match="group"):
        quantize_fp8(torch.zeros(2, 4), group=0)
