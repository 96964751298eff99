"""decode: the one-kernel expert layer for a few tokens, against float32 references: its partials
against `decode_experts_torch`, the layer through it against `fused_experts_torch`; on the GPU at
grid sizes in bf16 and FP8, through graphs, and a race test for the dependent (PDL) finalize."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close, random_expert_weights, random_ids, relative_error

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
from moe_triton.config import DecodeConfig, decode_config
from moe_triton.decode import decode_experts, decode_experts_torch, decode_supports
from moe_triton.expand import expand, per_pair_layout

H, I = 40, 33  # partial C steps, partial slices, partial output chunks

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


def routed(ids, E):
    return ((ids >= 0) & (ids < E)).reshape(-1)


@pytest.mark.parametrize("T,kind", [(0, LayoutKind.PER_PAIR), (1, LayoutKind.PER_PAIR),
                                    (3, LayoutKind.PER_PAIR), (5, LayoutKind.SORTED)], ids=str)
@pytest.mark.parametrize("E,K", [(1, 1), (4, 2), (3, 5)])  # K > E: ids filtered for other ranks
@pytest.mark.parametrize("dtype,block_n,tma", [(torch.float32, 16, False),
                                               (torch.float16, 32, True)], ids=str)
def test_decode_experts(T, kind, dtype, E, K, block_n, tma):
    x, weights, ids = layer(T, E, K, dtype, seed=T + K, filtered=0.3)
    if kind is LayoutKind.PER_PAIR:
        layout = per_pair_layout(ids, E, 16)
    else:
        layout = expand(ids, E, block_m=16)
    config = DecodeConfig(16, block_n, block_c=32, block_h=16, tma_weights=tma)
    y = decode_experts(x, weights, layout, config, Activation())
    expected = decode_experts_torch(x, weights, ids, block_n, Activation())
    assert y.shape == expected.shape == (-(-I // block_n), T * K, H) and y.dtype == torch.float32
    keep = routed(ids, E)  # a filtered pair's rows are never written (finalize skips them)
    assert_close(y[:, keep], expected[:, keep], dtype)


def cpu_config(layout=LayoutKind.PER_PAIR, block_n=32, block_c=32, quantize_input=True):
    tile = GemmConfig(16, 32, 32)
    return MoEConfig(tile, tile, layout, DecodeConfig(16, block_n, block_c, block_h=16,
                                                      quantize_input=quantize_input))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.kind.name)
@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
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
    x, weights, ids = layer(2, 4, 2, torch.float32, seed=0)
    nowhere = torch.tensor([[-1, 4], [4, -1]], dtype=torch.int32)
    out = run_experts(x, weights, nowhere, torch.rand(2, 2), config=cpu_config())
    assert torch.equal(out, torch.zeros_like(out))
    empty = run_experts(x[:0], weights, ids[:0], torch.rand(0, 2), config=cpu_config())
    assert empty.shape == (0, H)


def test_fp8_blocks_through_the_decode_kernel(poisoned_empty):
    """FP8 block-128 weights, fp16 activations (the interpreter's): x quantized per 128-column
    group (in the kernel, or by the quantize stage before it) and the intermediate per row and
    slice inside the kernel; against the dequantized
    float32 reference within FP8's error (test_fp8.py: FP8_RMS_TOL), NaN-free."""
    from test_fp8 import FP8_RMS_TOL

    x, native, ids = layer(3, 5, 2, torch.float32, seed=4, filtered=0.2)
    weights = native.to_format(WeightFormat.fp8_block(128, 128))
    x, topk_weights = x.half(), torch.rand(3, 2)
    for layout, quantize_input in ((LayoutKind.PER_PAIR, True), (LayoutKind.SORTED, False)):
        out = run_experts(x, weights, ids, topk_weights,
                          config=cpu_config(layout, block_c=128, quantize_input=quantize_input))
        reference = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights)
        rms = ((out.float() - reference).square().mean() / reference.square().mean()).sqrt()
        assert out.dtype == torch.float16 and not out.isnan().any() and rms <= FP8_RMS_TOL


def test_formats_it_does_not_read_are_refused_before_any_launch(no_launch):
    assert decode_supports(WeightFormat.fp8_block(128, 128))
    for fmt in (WeightFormat.fp8_block(32, 32), WeightFormat.fp8_channel(),
                WeightFormat.fp8_tensor(), WeightFormat.fp8_tensor(static_input=True)):
        assert not decode_supports(fmt)
    x, native, ids = layer(2, 4, 2, torch.float32, seed=1)
    channel = native.to_format(WeightFormat.fp8_channel())
    with pytest.raises(ValueError, match="config.decode: the decode kernel reads"):
        run_experts(x.half(), channel, ids, torch.rand(2, 2), config=cpu_config())
    with pytest.raises(ValueError, match="config.decode: the decode kernel reads hidden_states"):
        run_experts(x.T.contiguous().T, native, ids, torch.rand(2, 2), config=cpu_config())
    blocks = native.to_format(WeightFormat.fp8_block(128, 128))
    with pytest.raises(ValueError, match="config.decode: FP8 steps a whole 128-wide block"):
        run_experts(x.half(), blocks, ids, torch.rand(2, 2), config=cpu_config(block_c=32))


def test_decode_kernels_compile_for_sm90():
    """The decode kernel and its dependent finalize with decode_config's H200 tiles, bf16 and FP8
    block-128, and the two GEMMs chained by PDL, compiled for sm_90 without a GPU
    (tests/sm90_compile.py)."""
    shape = dict(E=4, E_real=128, K=8, H=2048, I=768, block=[128, 128])
    # (test_fp8.py compiles the FP8 chain at T = 1)
    cases = [dict(shape, T=1, format="native", decode=True),
             dict(shape, T=4, format="block", decode=True), dict(shape, T=2, format="native")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    harness = str(Path(__file__).with_name("sm90_compile.py"))
    run = subprocess.run([sys.executable, harness, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" decode ") == 2 and run.stdout.count("/pdl") == 1, run.stdout


# ---- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 16])
@pytest.mark.parametrize("shape_name", ["Qwen3-30B-A3B", "Mixtral-8x7B", "DeepSeek-V3", "E64-K4"])
def test_decode_layer_on_the_gpu(shape_name, T):
    from moe_triton.tools.bench import GRID_SHAPES, random_experts, random_inputs

    shape = GRID_SHAPES[shape_name]
    weights = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    config = decode_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"))
    out = run_experts(x, weights, ids, topk_weights, config=config)
    # the reference casts one expert at a time to float32 (DeepSeek-V3's are 45 GB at once)
    error = relative_error(out, fused_experts_torch(x, weights.w13, weights.w2, ids, topk_weights))
    print(f"\n{shape_name} T={T} {config.describe()}: relative error {error:.2e}")
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and error < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["two-GEMM", "two-GEMM FP8", "decode"])
@pytest.mark.parametrize("T", [1, 2])
def test_dependent_kernels_never_read_early(T, path):
    """The race test: the second GEMM (two-GEMM path, bf16 and FP8) and finalize launch as PDL
    dependents of the kernel before them and must wait for its output. Each call runs the planned
    stages on intermediates NaN-filled by kernels launched before the chain (one between two of
    its kernels would break their dependency), so a kernel that read its input early returns NaN
    or a value off the first call's (calls are bit-identical: no atomics): 200 eager calls, 10
    replays of a graph of 50."""
    from moe_triton.graphs import capture_graph
    from moe_triton.pipeline import plan_experts
    from moe_triton.tools.bench import GRID_SHAPES, random_experts, random_inputs

    shape = GRID_SHAPES["Qwen3-30B-A3B"]
    weights = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    if path.endswith("FP8"):
        weights = weights.to_format(WeightFormat.fp8_block(128, 128))
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    pick = decode_config if path == "decode" else choose_config
    config = pick(T, shape.top_k, shape.num_experts, shape.hidden_size,
                  shape.intermediate_size, torch.device("cuda"), weights.w13.dtype)
    plan = plan_experts(x, weights, ids, topk_weights, activation=Activation(), config=config,
                        out=None)
    assert plan.decode is not None or plan.down.launch.fixed["DEPENDENT"]

    def nan(shape, dtype=torch.float32):  # e4m3fn's NaN too
        return torch.full(shape, float("nan"), device="cuda").to(dtype)

    def call():
        layout = plan.expand(ids)
        out = nan((T, shape.hidden_size), torch.bfloat16)
        if plan.decode is not None:
            y = plan.decode(x, weights, layout, y=nan(plan.decode.out_shape))
            return plan.finalize(y, topk_weights, per_pair_layout(ids, shape.num_experts, 1), out)
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
    outputs = [call() for _ in range(200)]
    captured = []
    graph = capture_graph(lambda i: captured.append(call()), 50)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        outputs += [out.clone() for out in captured]
    assert all(torch.equal(out, first) for out in outputs)
