"""decode: the persistent one-launch expert layer for a few tokens, against float32 references
(`decode_layer_torch`, `fused_experts_torch`): on the CPU interpreter in its two-launch form at
small sizes (T = 0, filtered ids, K > E, every activation, FP8 blocks); on the GPU at grid sizes
in bf16 and FP8, a race test of its grid barrier and last-arrival sums, and one of the default
two-GEMM path's PDL chain."""

import pytest
import torch
from helpers import (
    assert_close,
    compile_for_sm90,
    random_expert_weights,
    random_ids,
    relative_error,
)

from moe_triton import (
    Activation,
    ActivationKind,
    ExpertWeights,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    WeightFormat,
    choose_config,
    fused_experts_torch,
    run_experts,
)
from moe_triton.config import DECODE_LAYOUTS, DecodeConfig, decode_config
from moe_triton.decode import (
    decode_layer,
    decode_layer_torch,
    decode_supports,
    plan_decode_layer,
)
from moe_triton.expand import expand, per_pair_layout

H, I = 40, 33  # partial C steps, partial column blocks, partial output blocks

ACTIVATIONS = [Activation(), Activation(ActivationKind.GELU_TANH_AND_MUL),
               Activation(ActivationKind.RELU2),
               Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5)]


def layer(T, E, K, dtype, seed, activation=Activation(), filtered=0.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13, w2 = random_expert_weights(g, E, H, I, activation.gated, dtype)
    ids = random_ids(T, min(K, E), E, seed, filtered)
    if K > E:  # an expert-parallel shard: the other ranks' slots hold the sentinel E
        ids = torch.cat([ids, torch.full((T, K - E), E)], dim=1)
    ids = ids.int().to(device)
    return x, ExpertWeights(w13.to(device), w2.to(device), activation.gated), ids


def layout_of(kind, ids, E):
    return per_pair_layout(ids, E, 16) if kind is LayoutKind.PER_PAIR else expand(ids, E, 16)


@pytest.mark.parametrize("T,kind", [(0, LayoutKind.PER_PAIR), (1, LayoutKind.PER_PAIR),
                                    (3, LayoutKind.PER_PAIR), (5, LayoutKind.SORTED)], ids=str)
@pytest.mark.parametrize("E,K", [(1, 1), (4, 2), (3, 5)])  # K > E: ids filtered for other ranks
@pytest.mark.parametrize("dtype,tma", [(torch.float32, False), (torch.float16, True)], ids=str)
def test_decode_layer(T, kind, dtype, E, K, tma):
    x, weights, ids = layer(T, E, K, dtype, seed=T + K, filtered=0.3)
    topk_weights = torch.rand(T, K)
    config = DecodeConfig(16, 16, 16, 16, 16, programs=3, tma_weights=tma)
    out = decode_layer(x, weights, layout_of(kind, ids, E), topk_weights, config, Activation())
    expected = decode_layer_torch(x, weights, ids, topk_weights, Activation())
    assert out.shape == (T, H) and out.dtype == dtype
    assert_close(out, expected, dtype, scale=2)


def test_activations_through_tma_from_a_view_off_a_16_byte_boundary():
    """x and h through TMA descriptors (16-byte rows: I = 32 here), x a view one value past a
    16-byte boundary, which a copy realigns before the launch."""
    g = torch.Generator().manual_seed(3)
    weights = ExpertWeights(*random_expert_weights(g, 4, H, 32, True, torch.float16))
    ids, topk_weights = random_ids(3, 2, 4, 3).int(), torch.rand(3, 2)
    wide = torch.randn(3, H + 8, generator=g).half()  # 96-byte rows
    x = wide.view(-1)[1:].as_strided((3, H), (H + 8, 1))  # each row one value in
    layout = per_pair_layout(ids, 4, 16)
    config = DecodeConfig(16, 16, 16, 16, 16, programs=2)
    plan = plan_decode_layer(x, weights, layout, topk_weights, config, Activation())
    assert plan.h_desc is not None and x.data_ptr() % 16
    out = plan(x, weights, layout, topk_weights)
    assert_close(out, decode_layer_torch(x, weights, ids, topk_weights, Activation()),
                 torch.float16, scale=2)


def test_programs_change_no_bit():
    """Who computes a unit is the grid's choice; what is summed, in which order, is not: any
    program count gives the same bits (and so does a second call on the same plan)."""
    x, weights, ids = layer(3, 6, 3, torch.float16, seed=7, filtered=0.2)
    topk_weights = torch.rand(3, 3)
    outputs = [decode_layer(x, weights, expand(ids, 6, 16), topk_weights,
                            DecodeConfig(16, 16, 16, 16, 16, programs=programs),
                            Activation()) for programs in (1, 2, 5, 5)]
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def cpu_config(layout=LayoutKind.PER_PAIR, block_n=16, block_c=16):
    tile = GemmConfig(16, 32, 32)
    return MoEConfig(tile, tile, layout, DecodeConfig(16, block_n, block_c, block_h=16, block_i=16,
                                                      programs=3))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.kind.name)
@pytest.mark.parametrize("layout", DECODE_LAYOUTS, ids=lambda k: k.value)
def test_layer_through_the_decode_kernel(activation, layout, poisoned_empty):
    x, weights, ids = layer(4, 6, 3, torch.float16, seed=2, activation=activation, filtered=0.2)
    topk_weights = torch.rand(4, 3)
    out = run_experts(x, weights, ids, topk_weights, activation=activation,
                      config=cpu_config(layout))
    expected = fused_experts_torch(x, weights.w13, weights.w2, ids, topk_weights,
                                   activation=activation)
    assert out.dtype == torch.float16
    assert_close(out, expected, torch.float16, scale=2)


def test_every_pair_filtered_and_no_tokens(poisoned_empty):
    x, weights, ids = layer(3, 4, 2, torch.float32, seed=0)
    some = torch.tensor([[-1, 4], [1, -1], [4, -1]], dtype=torch.int32)  # tokens 0, 2: none
    topk_weights = torch.rand(3, 2)
    out = run_experts(x, weights, some, topk_weights, config=cpu_config())
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_close(out, fused_experts_torch(x, weights.w13, weights.w2, some, topk_weights),
                 torch.float32)
    empty = run_experts(x[:0], weights, ids[:0], torch.rand(0, 2), config=cpu_config())
    assert empty.shape == (0, H)


def test_fp8_blocks_through_the_decode_kernel(poisoned_empty):
    """FP8 block-128 weights dequantized in registers, fp16 activations as they are (W8A16):
    against the float32 reference on the same dequantized weights, within fp16's error (only
    the activations' and the intermediate's fp16 roundings differ), NaN-free."""
    x, native, ids = layer(3, 5, 2, torch.float32, seed=4, filtered=0.2)
    weights = native.to_format(WeightFormat.fp8_block(128, 128))
    x, topk_weights = x.half(), torch.rand(3, 2)
    for layout in DECODE_LAYOUTS:
        out = run_experts(x, weights, ids, topk_weights, config=cpu_config(layout))
        reference = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights)
        assert out.dtype == torch.float16 and not out.isnan().any()
        assert_close(out, reference, torch.float16, scale=2)


def test_formats_it_does_not_read_are_refused_before_any_launch(no_launch):
    assert decode_supports(WeightFormat.fp8_block(128, 128))
    for fmt in (WeightFormat.fp8_block(32, 32), WeightFormat.fp8_channel(),
                WeightFormat.fp8_tensor(), WeightFormat.fp8_tensor(static_input=True),
                WeightFormat.mxfp4()):
        assert not decode_supports(fmt)
    x, native, ids = layer(2, 4, 2, torch.float32, seed=1)
    channel = native.to_format(WeightFormat.fp8_channel())
    with pytest.raises(ValueError, match="config.decode: the decode kernel reads"):
        run_experts(x.half(), channel, ids, torch.rand(2, 2), config=cpu_config())
    with pytest.raises(ValueError, match="config.decode: the decode kernel reads hidden_states"):
        run_experts(x.T.contiguous().T, native, ids, torch.rand(2, 2), config=cpu_config())
    blocks = native.to_format(WeightFormat.fp8_block(128, 128))
    tile = GemmConfig(16, 32, 32)
    wide = MoEConfig(tile, tile, LayoutKind.PER_PAIR, DecodeConfig(16, 256, 32, 16))
    with pytest.raises(ValueError, match="config.decode: FP8 tiles lie within one 128-wide"):
        run_experts(x.half(), blocks, ids, torch.rand(2, 2), config=wide)


def test_decode_kernels_compile_for_sm90():
    """The decode kernel (both phases) with decode_config's H200 tiles, bf16 and FP8 block-128,
    and the two GEMMs chained by PDL, compiled for sm_90 without a GPU (tests/sm90_compile.py)."""
    shape = dict(E=4, E_real=128, K=8, H=2048, I=768, block=[128, 128])
    cases = [dict(shape, T=1, format="native", decode=True),
             dict(shape, T=4, format="block", decode=True), dict(shape, T=2, format="native")]
    run = compile_for_sm90(cases, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" decode ") == 2 and run.stdout.count("/pdl") == 1, run.stdout


# ---- on the GPU ------------------------------------------------------------------------------

def eager_and_replayed(call) -> list[torch.Tensor]:
    """The race tests' outputs: 200 eager calls, then 10 replays of a graph of 50 calls."""
    from moe_triton.graphs import capture_graph

    outputs = [call() for _ in range(200)]
    captured = []
    graph = capture_graph(lambda i: captured.append(call()), 50)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        outputs += [out.clone() for out in captured]
    return outputs


def grid_layer(shape_name, T, fp8=False):
    from moe_triton.tools.bench import GRID_SHAPES, random_experts, random_inputs

    shape = GRID_SHAPES[shape_name]
    weights = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    if fp8:
        weights = weights.to_format(WeightFormat.fp8_block(128, 128))
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    config = decode_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"), weights.w13.dtype)
    return (shape, weights, inputs.hidden_states[0], inputs.topk_ids[0],
            inputs.topk_weights[0], config)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 2, 4, 16])
@pytest.mark.parametrize("shape_name", ["Qwen3-30B-A3B", "Mixtral-8x7B", "DeepSeek-V3", "E64-K4"])
def test_decode_layer_on_the_gpu(shape_name, T, fp8):
    """bf16 activations against float32 torch on the same (dequantized) weights: only bf16
    roundings of x, the intermediate and the output differ."""
    shape, weights, x, ids, topk_weights, config = grid_layer(shape_name, T, fp8)
    out = run_experts(x, weights, ids, topk_weights, config=config)
    # the reference casts one expert at a time to float32 (DeepSeek-V3's are 45 GB at once);
    # FP8 dequantizes the experts hit only, renumbered
    w13, w2 = weights.w13, weights.w2
    if fp8:
        hit, ids = ids.unique(return_inverse=True)
        w13, w2 = ExpertWeights(w13[hit], w2[hit], True, weights.format, weights.w13_scale[hit],
                                weights.w2_scale[hit]).dequantized()
    error = relative_error(out, fused_experts_torch(x, w13, w2, ids.int(), topk_weights))
    print(f"\n{shape_name} T={T} {config.describe()}: relative error {error:.2e}")
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and error < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 2])
def test_the_barrier_and_the_last_arrivals_never_read_early(T, fp8):
    """The race test: the one-launch kernel's down phase reads sums other programs stored
    before the grid barrier, and a token's last arriving pair reads the rows the others stored.
    Its float scratch is NaN-filled before every call, so an early read gives NaN or other
    bits than the two-launch form's (a kernel boundary in place of the barrier, same sums in
    the same order): 200 eager calls, 10 replays of a graph of 50, all bit-equal to it."""
    from moe_triton.pipeline import plan_experts

    shape, weights, x, ids, topk_weights, config = grid_layer("Qwen3-30B-A3B", T, fp8)
    plan = plan_experts(x, weights, ids, topk_weights, activation=Activation(), config=config,
                        out=None)
    assert len(plan.decode.launches) == 1 and plan.decode.launches[0].fixed["PHASES"] == 3
    from moe_triton.decode import plan_decode_layer

    layout = plan.expand(ids)
    apart = plan_decode_layer(x, weights, layout, topk_weights, config.decode, Activation(),
                              one_launch=False)
    expected = apart(x, weights, layout, topk_weights)
    assert not expected.isnan().any()

    def call():
        layout = plan.expand(ids)
        for name in ("h_ptr", "y_ptr"):
            plan.decode.scratch[name].fill_(float("nan"))
        return plan.decode(x, weights, layout, topk_weights)

    assert all(torch.equal(out, expected) for out in eager_and_replayed(call))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["two-GEMM", "two-GEMM FP8"])
@pytest.mark.parametrize("T", [1, 2])
def test_dependent_kernels_never_read_early(T, path):
    """The race test of the default decode path: the second GEMM (bf16 and FP8) and finalize
    launch as PDL dependents of the kernel before them and must wait for its output. Each call
    runs the planned stages on intermediates NaN-filled by kernels launched before the chain (one
    between two of its kernels would break their dependency), so a kernel that read its input
    early returns NaN or a value off the first call's (calls are bit-identical: no atomics): 200
    eager calls, 10 replays of a graph of 50."""
    from moe_triton.pipeline import plan_experts
    from moe_triton.tools.bench import GRID_SHAPES, random_experts, random_inputs

    shape = GRID_SHAPES["Qwen3-30B-A3B"]
    weights = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    if path.endswith("FP8"):
        weights = weights.to_format(WeightFormat.fp8_block(128, 128))
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"), weights.w13.dtype)
    plan = plan_experts(x, weights, ids, topk_weights, activation=Activation(), config=config,
                        out=None)
    assert plan.down.launch.fixed["CHAINED"]

    def nan(shape, dtype=torch.float32):  # e4m3fn's NaN too
        return torch.full(shape, float("nan"), device="cuda").to(dtype)

    def call():
        layout = plan.expand(ids)
        out = nan((T, shape.hidden_size), torch.bfloat16)
        a, a_scales = x, None
        if plan.quantize is not None:
            q = (nan(plan.quantize.shape, torch.float8_e4m3fn),
                 nan((T, plan.quantize.num_groups)))
            a, a_scales = plan.quantize(x, out=q)
        h = nan(plan.up.out_shape, plan.up.out_dtype)
        y = nan(plan.down.out_shape, plan.down.out_dtype)
        h, h_scales = plan.up(a, weights.w13, layout, a_scales, weights.w13_scale, out=h)
        plan.down(h, weights.w2, layout, h_scales, weights.w2_scale, out=y)
        return plan.finalize(y, topk_weights, layout, out)

    first = run_experts(x, weights, ids, topk_weights, config=config)
    assert not first.isnan().any()
    assert all(torch.equal(out, first) for out in eager_and_replayed(call))
