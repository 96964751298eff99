"""expert GEMM: every row in use against a float32 einsum over the same (token, expert) rows."""
import gc
import importlib
import weakref

import pytest
import torch
from helpers import assert_close, random_ids

from moe_triton import ExpertWeights, WeightFormat
from moe_triton.activation import Activation, ActivationKind, activation_torch
from moe_triton.config import GemmConfig
from moe_triton.expand import expand
from moe_triton.expert_gemm import Fp8Scales, ScaleAlongC, expert_gemm, expert_gemm_torch
from moe_triton.quantize import dequantize_fp8_torch, quantize_fp8

expert_gemm_module = importlib.import_module("moe_triton.expert_gemm")


def rows_in_use(layout):
    rows = int(layout.num_rows.item())
    pairs = layout.sorted_pair_ids[:rows].long()
    real = pairs < layout.num_pairs
    row_ids = torch.arange(rows)[real]
    experts = layout.block_expert.long().repeat_interleave(layout.block_m)[:rows][real]
    return row_ids, pairs[real] // layout.top_k, experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation",
                         [None, Activation(ActivationKind.SILU_AND_MUL),
                          Activation(ActivationKind.RELU2)],
                         ids=lambda a: a.kind.name if a else "plain")
@pytest.mark.parametrize("T,E,K,N,K_in",
                         [(1, 1, 1, 16, 16), (3, 4, 2, 66, 40), (17, 8, 8, 50, 225),
                          (64, 8, 2, 161, 72)])
def test_expert_gemm_gather(T, E, K, N, K_in, activation, dtype, poisoned_empty):
    torch.manual_seed(T + N)
    x = torch.randn(T, K_in).to(dtype)
    gated = activation is not None and activation.gated
    w = (torch.randn(E, 2 * N if gated else N, K_in) / K_in**0.5).to(dtype)
    layout = expand(random_ids(T, K, E, seed=T).int(), E, 16)
    out = expert_gemm(x, w, layout, GemmConfig(16, 32, 32, group_m=2), gather=True,
                      activation=activation)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(x, w, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expert_gemm_row_space_and_transposed_weights(dtype, poisoned_empty):
    torch.manual_seed(0)
    T, E, K, N, K_in = 17, 4, 2, 40, 33
    layout = expand(random_ids(T, K, E, seed=5).int(), E, 16)
    a = torch.randn(layout.max_rows, K_in).to(dtype)
    # stored transposed, used as a (E, N, K_in) view
    w_t = (torch.randn(E, K_in, N) / K_in**0.5).to(dtype)
    out = expert_gemm(a, w_t.transpose(1, 2), layout, GemmConfig(16, 32, 16), gather=False)
    row_ids, _, experts = rows_in_use(layout)
    assert_close(out[row_ids], expert_gemm_torch(a, w_t.transpose(1, 2), row_ids, experts), dtype)


def test_expert_gemm_rejects_mismatched_block_m():
    layout = expand(random_ids(3, 1, 2, 0).int(), 2, 32)
    with pytest.raises(ValueError, match="block_m"):
        expert_gemm(torch.randn(3, 16), torch.randn(2, 16, 16), layout, GemmConfig(16, 32, 32),
                    gather=True)


@pytest.mark.parametrize("activation", [None, Activation(ActivationKind.SILU_AND_MUL)],
                         ids=lambda a: a.kind.name if a else "plain")
# N not a multiple of block_n: tiles spill into the next expert
@pytest.mark.parametrize("N,K_in", [(40, 32), (33, 64)])
def test_expert_gemm_tma_weights(N, K_in, activation, poisoned_empty):
    torch.manual_seed(N)
    T, E, K = 17, 4, 2
    x = torch.randn(T, K_in).half()
    gated = activation is not None
    w = (torch.randn(E, 2 * N if gated else N, K_in) / K_in**0.5).half()
    layout = expand(random_ids(T, K, E, seed=1).int(), E, 16)
    config = GemmConfig(16, 32, 16, tma_weights=True)
    out = expert_gemm(x, w, layout, config, gather=True, activation=activation)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(x, w, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, torch.float16)


# The persistent form (programs walk the tiles of the rows in use) with 1, 3 or more programs than
# tiles; experts left empty, filtered slots, partial row and column tiles, C ending mid-step.
@pytest.mark.parametrize("programs", [1, 3, 64])
@pytest.mark.parametrize("activation,dtype", [(None, torch.float32),
                                              (Activation(ActivationKind.SILU_AND_MUL),
                                               torch.float16)], ids=["plain-fp32", "gated-fp16"])
def test_persistent_tiles_cover_the_rows_in_use(programs, activation, dtype, poisoned_empty):
    torch.manual_seed(programs)
    T, E, K, N, C = 29, 7, 2, 40, 72
    x = torch.randn(T, C).to(dtype)
    gated = activation is not None
    w = (torch.randn(E, 2 * N if gated else N, C) / C**0.5).to(dtype)
    ids = random_ids(T, K, E, seed=programs, filtered=0.2)
    ids[ids == 5] = 6  # expert 5 gets no rows
    layout = expand(ids.int(), E, 16)
    config = GemmConfig(16, 32, 32, group_m=2, persistent_programs=programs,
                        tma_weights=dtype == torch.float16)
    out = expert_gemm(x, w, layout, config, gather=True, activation=activation)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(x, w, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, dtype)


@pytest.mark.parametrize("persistent", [0, 2], ids=["grid", "persistent"])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_row_space_activations_through_tma(T, persistent, poisoned_empty):
    """The second GEMM's a (row space, contiguous) through a TMA descriptor: padding rows hold
    garbage (never written by the first GEMM) that must not reach a row in use."""
    torch.manual_seed(T)
    E, K, N, C = 4, 2, 48, 40  # C * 2 bytes: a 16-byte multiple
    layout = expand(random_ids(T, K, E, seed=T).int(), E, 16)
    a = torch.randn(layout.max_rows, C).half()
    a[layout.sorted_pair_ids >= layout.num_pairs] = float("nan")  # padding rows, unused ones
    w = (torch.randn(E, N, C) / C**0.5).half()
    config = GemmConfig(16, 32, 16, tma_weights=True, tma_activations=True,
                        persistent_programs=persistent)
    plan = expert_gemm_module.plan_expert_gemm(a, w, layout, config, gather=False)
    assert plan.a_descriptor and (plan.launch is None) == (T == 0)
    out = expert_gemm(a, w, layout, config, gather=False)
    row_ids, _, experts = rows_in_use(layout)
    assert out.shape == (layout.max_rows, N)
    assert_close(out[row_ids], expert_gemm_torch(a, w, row_ids, experts), torch.float16)


@pytest.mark.parametrize("block_n,per_tile,scalar", [(32, True, True), (16, True, False),
                                                     (32, False, False)],
                         ids=["one-per-tile", "narrow-blocks", "per-column"])
@pytest.mark.parametrize("persistent", [0, 3], ids=["grid", "persistent"])
def test_fp8_weight_block_scale_once_per_tile(block_n, per_tile, scalar, persistent,
                                              poisoned_empty):
    """With scale_per_tile, weight blocks at least a tile wide load one scale per step (an FMA per
    element in the promotion); narrower ones, or without it, a scale per column. Each against the
    dequantized float32 math."""
    T, E, K, N, C = 9, 3, 2, 50, 96
    a, w, scales, a_ref, w_ref = fp8_operands(T, E, N, C, 32, WeightFormat.fp8_block(block_n, 32),
                                              True, seed=block_n + persistent)
    activation = Activation(ActivationKind.SILU_AND_MUL)
    layout = expand(random_ids(T, K, E, seed=7).int(), E, 16)
    config = GemmConfig(16, 32, 32, persistent_programs=persistent, scale_per_tile=per_tile)
    plan = expert_gemm_module.plan_expert_gemm(a, w, layout, config, gather=True,
                                               activation=activation, scales=scales,
                                               out_dtype=torch.float32)
    assert plan.launch.fixed["W_SCALAR"] is scalar
    out = expert_gemm(a, w, layout, config, gather=True, activation=activation, scales=scales,
                      out_dtype=torch.float32)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = activation_torch(expert_gemm_torch(a_ref, w_ref, tokens, experts), activation)
    assert_close(out[row_ids], expected, torch.float32)


def test_weight_descriptors_live_as_long_as_their_weights():
    """A weight tensor keeps its TMA descriptors (one per tile) while it stays at one address, gets
    new ones when its storage moves, and leaves nothing behind when it dies: the cache holds views
    of the storage, never the tensor."""
    descriptors = expert_gemm_module._DESCRIPTORS
    w = torch.randn(4, 64, 32)
    first = expert_gemm_module.weight_descriptor(w, (64, 32))
    assert expert_gemm_module.weight_descriptor(w, (64, 32)) is first
    assert expert_gemm_module.weight_descriptor(w, (32, 32)) is not first
    w.data = torch.randn(4, 64, 32)  # a parameter's storage replaced in place (e.g. module.half())
    moved = expert_gemm_module.weight_descriptor(w, (64, 32))
    assert moved is not first and moved.base.data_ptr() == w.data_ptr()
    alive, key = weakref.ref(w), id(w)
    del w, first, moved
    gc.collect()
    assert alive() is None and key not in descriptors


# ---- FP8 operands --------------------------------------------------------------------------------

def fp8_operands(T, E, N, C, a_group, w_format, gated, seed):
    """x quantized per a_group columns (or per row: None), w13-like weights (E, 2N or N, C) in
    w_format; their Fp8Scales, and both dequantized in float32 (the reference's operands)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).half()
    weights = ExpertWeights(torch.randn(E, 2 * N if gated else N, C, generator=g) / C**0.5,
                            torch.randn(E, C, N, generator=g), gated).to_format(w_format)
    a, a_scales = quantize_fp8(x, a_group)
    scales = Fp8Scales(a_scales, a_group or C, weights.w13_scale, w_format.block,
                       weights.w13_scale_up_offset)
    a_ref = dequantize_fp8_torch(a, a_scales, a_group)
    return a, weights.w13, scales, a_ref, weights.dequantized()[0]


def test_the_specs_emit_the_kernel_arguments():
    """The launch takes the activation's, the tile config's and the FP8 scales' own arguments."""
    from moe_triton.expert_gemm import plan_expert_gemm

    a, w, scales, _, _ = fp8_operands(5, 3, 48, 64, 16, WeightFormat.fp8_block(16, 16), True,
                                      seed=9)
    activation = Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5, swiglu_alpha=1.5)
    config = GemmConfig(16, 32, 32, group_m=2, num_warps=2, num_stages=2)
    layout = expand(random_ids(5, 2, 3, seed=2).int(), 3, 16)
    plan = plan_expert_gemm(a, w, layout, config, gather=True, activation=activation, scales=scales,
                            out_dtype=torch.float8_e4m3fn)
    fixed = plan.launch.fixed
    for emitted in (activation.kernel_args(), config.kernel_args(),
                    scales.kernel_args(64, config.block_n, config.block_c)):
        assert emitted.items() <= fixed.items()
    assert ((fixed["ACT_LIMIT"], fixed["A_SCALE"], fixed["W_BLOCK_N"])
            == (0.5, ScaleAlongC.IN_STEP.value, 16))
    assert plan.launch.options == config.launch_options() == dict(num_warps=2, num_stages=2)


@pytest.mark.parametrize("a_group,w_format,block_c,tma,gated", [
    # the demo's 16 x 16 blocks: both in the step
    (16, WeightFormat.fp8_block(16, 16), 32, False, True),
    (16, WeightFormat.fp8_block(16, 16), 32, True, True),
    (16, WeightFormat.fp8_block(16, 16), 32, False, False),
    (16, WeightFormat.fp8_block(16, 16), 64, False, True),
    # the second GEMM's: a per step, w in it
    (32, WeightFormat.fp8_block(16, 16), 32, False, False),
    (32, WeightFormat.fp8_block(16, 16), 32, True, False),
    (16, WeightFormat.fp8_channel(), 32, False, True),  # a inside the step, w per output row
    (None, WeightFormat.fp8_block(32, 16), 32, False, True),  # a per row, w inside the step
], ids=["a16-w16x16-step32", "a16-w16x16-step32-tma", "a16-w16x16-step32-plain",
        "a16-w16x16-step64",
        "a32-w16x16-step32-plain", "a32-w16x16-step32-plain-tma", "a16-channel-step32",
        "row-w32x16-step32"])
def test_fp8_scale_groups_narrower_than_the_step(a_group, w_format, block_c, tma, gated,
                                                 poisoned_empty):
    """An 8-bit tl.dot needs K >= 32 on SM90, so groups of 16 columns are scaled within a 32- or
    64-wide step: against float32 math on the dequantized operands, odd sizes (C = 72 ends in half
    a group, N = 50 in a partial block). Under the interpreter the tile products are float32."""
    T, E, K, N, C = 7, 3, 2, 50, 72
    seed = block_c + (a_group or 0)
    a, w, scales, a_ref, w_ref = fp8_operands(T, E, N, C, a_group, w_format, gated, seed)
    activation = Activation(ActivationKind.SILU_AND_MUL) if gated else None
    layout = expand(random_ids(T, K, E, seed=3).int(), E, 16)
    config = GemmConfig(16, 32, block_c, tma_weights=tma)
    out = expert_gemm(a, w, layout, config, gather=True, activation=activation, scales=scales,
                      out_dtype=torch.float32)
    assert ScaleAlongC.IN_STEP in {scales.a_along_c(C, block_c), scales.w_along_c(block_c)}
    row_ids, tokens, experts = rows_in_use(layout)
    expected = expert_gemm_torch(a_ref, w_ref, tokens, experts)
    if activation is not None:
        expected = activation_torch(expected, activation)
    assert_close(out[row_ids], expected, torch.float32)


@pytest.mark.parametrize("a_group,w_format,block_c", [
    (32, WeightFormat.fp8_block(32, 32), 32),  # scales per step: the FP8 dot
    (16, WeightFormat.fp8_block(16, 16), 32),  # scales inside the step: the float32 tiles' dot
    (None, WeightFormat.fp8_channel(), 32),  # scales on the sum
], ids=["per-step", "in-step", "per-sum"])
def test_fp8_nan_reaches_the_rows_and_columns_it_touches(a_group, w_format, block_c,
                                                         poisoned_empty):
    """An e4m3 NaN (0x7f) in a row of a makes that row NaN, one in a weight row n makes column n
    NaN, as in float32 math; and the FP8 epilogue's row scales keep the NaN (the interpreter's dot
    reads 0x7f as 480 and tl.max drops NaN: both turned these rows finite)."""
    T, E, K, N, C = 7, 3, 2, 40, 64
    a, w, scales, a_ref, w_ref = fp8_operands(T, E, N, C, a_group, w_format, True, seed=1)
    a.view(torch.uint8)[2, 5] = 0x7F
    w.view(torch.uint8)[1, N + 3, 9] = 0xFF  # the up half of expert 1, output column 3: -NaN
    a_ref[2, 5] = w_ref[1, N + 3, 9] = float("nan")
    activation = Activation(ActivationKind.SILU_AND_MUL)
    layout = expand(random_ids(T, K, E, seed=4).int(), E, 16)
    config = GemmConfig(16, 32, block_c)
    row_ids, tokens, experts = rows_in_use(layout)
    expected = activation_torch(expert_gemm_torch(a_ref, w_ref, tokens, experts), activation)
    assert expected.isnan().any(1).sum() > 1 and not expected.isnan().all()
    out = expert_gemm(a, w, layout, config, gather=True, activation=activation, scales=scales,
                      out_dtype=torch.float32)
    assert torch.equal(out[row_ids].isnan(), expected.isnan())
    q, q_scales = expert_gemm(a, w, layout, config, gather=True, activation=activation,
                              scales=scales, out_dtype=torch.float8_e4m3fn)
    # quantized per row and 32 columns: a NaN makes its whole group NaN
    nan = expected.isnan()
    group_nan = torch.stack([nan[:, :32].any(1), nan[:, 32:].any(1)], dim=1)  # [rows, 2]
    assert torch.equal(q_scales[row_ids].isnan(), group_nan)
    assert torch.equal(dequantize_fp8_torch(q[row_ids], q_scales[row_ids], 32).isnan(),
                       group_nan.repeat_interleave(32, 1)[:, :N])
