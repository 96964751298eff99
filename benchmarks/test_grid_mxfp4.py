"""MXFP4 experts (W4A16) over the grid's shapes and gpt-oss's two expert layers, against the MXFP4
floor and against our bf16 and FP8 (block-128) layers on the same weights, in one run.

Floor = max(bytes / B, FLOPs / F): bytes = the packed e2m1 weights (half a byte a value), their E8M0
scales (one byte per 32) and biases of the experts hit, plus the bf16 activations in and out; F is
bf16's tensor-core rate (W4A16 multiplies in bf16). gpt-oss shapes carry their biases and clamped
swiglu in every format; the grid shapes are SiLU-gated without biases. Each case first checks the
MXFP4 output against our bf16 layer on the dequantized weights (the same values: relative RMS of
bf16 rounding only). Timing as in test_grid_fp8.py.

    pytest benchmarks/test_grid_mxfp4.py -m gpu --benchmark-only --bench-table grid-mxfp4.md
"""
import functools

import pytest
import torch
from test_grid_fp8 import GRAPH_MAX_TOKENS, VARIANTS, relative_rms

from moe_triton import (
    Activation,
    ActivationKind,
    ExpertWeights,
    WeightFormat,
    choose_config,
    run_experts,
)
from moe_triton.tools.bench import (
    DEEPSEEK_V3,
    E64_K4,
    GPT_OSS_20B,
    GPT_OSS_120B,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    LayerShape,
    floor_seconds,
    layer_bytes,
    layer_flops,
    random_experts,
    random_inputs,
    time_step,
)

TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
SHAPES = [GPT_OSS_120B, GPT_OSS_20B, QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4]
TABLE = "MXFP4 experts over the grid (W4A16: e2m1 weights, bf16 activations in and out)"


def gpt_oss(shape: LayerShape) -> bool:
    return shape.name.startswith("gpt-oss")


@functools.lru_cache(maxsize=1)
def weights(shape: LayerShape) -> dict[str, ExpertWeights]:
    """The same layer as MXFP4, as its dequantized bf16 values and as FP8 of those."""
    torch.cuda.empty_cache()
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    biases = {}
    if gpt_oss(shape):
        g = torch.Generator(device="cuda").manual_seed(2)
        biases = dict(w13_bias=torch.randn(shape.num_experts, 2 * shape.intermediate_size,
                                           generator=g, device="cuda").bfloat16(),
                      w2_bias=torch.randn(shape.num_experts, shape.hidden_size, generator=g,
                                          device="cuda").bfloat16())
    mxfp4 = ExpertWeights(w13, w2, **biases).to_format(WeightFormat.mxfp4())
    del w13, w2
    bf16 = ExpertWeights(*(w.bfloat16() for w in mxfp4.dequantized()), **biases)
    return dict(mxfp4=mxfp4, bf16=bf16, fp8=bf16.to_format(WeightFormat.fp8_block()))


def mxfp4_bytes(shape: LayerShape, topk_ids: torch.Tensor, biased: bool) -> int:
    H, I = shape.hidden_size, shape.intermediate_size
    extra = 3 * H * I // 32 + (2 * (2 * I + H) if biased else 0)  # scales, bf16 biases
    return layer_bytes(shape, topk_ids, 0.5, extra)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_grid_mxfp4(benchmark, shape, num_tokens, ceilings, record):
    layers = weights(shape)
    activation = Activation(ActivationKind.CLAMPED_SWIGLU) if gpt_oss(shape) else Activation()
    inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
    graphable = num_tokens <= GRAPH_MAX_TOKENS

    def step(fmt):
        return lambda i: run_experts(inputs.hidden_states[i], layers[fmt], inputs.topk_ids[i],
                                     inputs.topk_weights[i], activation=activation)

    rel_rms = relative_rms(step("mxfp4")(0), step("bf16")(0))
    assert rel_rms < 0.02, f"{shape.name} M={num_tokens}: relative RMS {rel_rms:.4f} vs bf16"
    times = {fmt: time_step(step(fmt), VARIANTS, graphable)[0] for fmt in ("mxfp4", "bf16", "fp8")}
    ours_s = times["mxfp4"]
    bytes_moved = sum(mxfp4_bytes(shape, ids, gpt_oss(shape))
                      for ids in inputs.topk_ids) / VARIANTS
    flops = layer_flops(shape, num_tokens)
    floor = floor_seconds(bytes_moved, flops, ceilings)
    config = choose_config(num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"), torch.uint8)
    record(TABLE, dict(
        shape=shape.name, M=num_tokens, mxfp4_us=f"{ours_s * 1e6:.1f}",
        timing="graph" if graphable else "do_bench", floor_us=f"{floor * 1e6:.1f}",
        floor_frac=f"{floor / ours_s:.2f}",
        bound="memory" if bytes_moved / ceilings.bandwidth >= flops / ceilings.matmul_flops
        else "compute",
        bf16_us=f"{times['bf16'] * 1e6:.1f}", vs_bf16=f"{times['bf16'] / ours_s:.2f}x",
        fp8_us=f"{times['fp8'] * 1e6:.1f}", vs_fp8=f"{times['fp8'] / ours_s:.2f}x",
        rel_rms_vs_bf16=f"{rel_rms:.4f}", config=config.describe(),
    ))
    benchmark.extra_info.update(dict(
        shape=shape.name, num_experts=shape.num_experts, top_k=shape.top_k,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_tokens=num_tokens, dtype="mxfp4", backend="triton", ours_s=ours_s, floor_s=floor,
        roofline_fraction=floor / ours_s, bf16_s=times["bf16"], fp8_s=times["fp8"],
        config=config.describe()))
    benchmark.pedantic(lambda: (step("mxfp4")(0), torch.cuda.synchronize()), rounds=3,
                       warmup_rounds=1)
