"""FP8 experts over the grid: the block-scaled format at 4 shapes x M in {1 .. 16384}, and the
Qwen3 shape per-channel and per-tensor, against the FP8 floor, our bf16 layer and transformers'
own FP8 experts on the same weights.

Floor = max(bytes / B, FLOPs / F8): bytes = the FP8 weights and scales of the experts hit plus the
bf16 activations in and out; B a large device copy, F8 a large FP8 `torch._scaled_mm`, both measured
in this run. Timing as in test_grid.py: CUDA-graph replay at M <= 256 (four input sets rotate so
weights come from HBM), `triton.testing.do_bench` above, plus graph replay at every size. Every case
first checks its output against our bf16 layer on the weights the FP8 ones stand for (relative RMS:
four FP8 roundings of 2^-4 at most, see tests/test_fp8.py). transformers' FP8 experts need a kernel
the GPU machine cannot download; benchmarks/fp8_peer.py loads its source when it is present.

    pytest benchmarks/test_grid_fp8.py -m gpu --benchmark-only --bench-table grid-fp8.md
"""
import functools

import fp8_peer
import pytest
import torch

from moe_triton import ExpertWeights, WeightFormat, choose_config, fused_experts, run_experts
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import (
    DEEPSEEK_V3,
    E64_K4,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    LayerShape,
    floor_seconds,
    layer_bytes,
    layer_flops,
    random_experts,
    random_inputs,
    time_graph_replays,
    time_step,
)

VARIANTS = 4
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
GRAPH_MAX_TOKENS = 256
# transformers' batched form runs one (token, slot) pair per program: a decode path
BATCHED_MAX_TOKENS = 1024
FORMATS = {"block": WeightFormat.fp8_block(128, 128), "channel": WeightFormat.fp8_channel(),
           "tensor": WeightFormat.fp8_tensor()}
CASES = ([(shape, "block") for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4)]
         + [(QWEN3_30B_A3B, "channel"), (QWEN3_30B_A3B, "tensor")])
TABLE = "FP8 experts over the grid (e4m3 weights, bf16 activations in and out, SiLU-gated)"


# one case's weights at a time: DeepSeek-V3's bf16 experts alone are 22.5 GB
@functools.lru_cache(maxsize=1)
def weights(shape: LayerShape, fmt_name: str) -> tuple[ExpertWeights, ExpertWeights]:
    torch.cuda.empty_cache()
    native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    return native, native.to_format(FORMATS[fmt_name])


def relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def transformers_fp8_times(shape, fp8: ExpertWeights, inputs, num_tokens, fmt_name,
                           reference: torch.Tensor) -> dict[str, float | str]:
    """transformers' fp8 grouped_mm / batched_mm experts forwards on the same FP8 weights (each
    first checked against `reference`, our bf16 layer's output), or why they did not run."""
    why = (fp8_peer.available() if fmt_name == "block"
           else "transformers' FP8 experts are block-scaled only")
    if why is not None:
        return {"grouped": why, "batched": why}
    times = {}
    forwards = fp8_peer.fp8_experts_forwards(fp8.w13, fp8.w13_scale, fp8.w2, fp8.w2_scale,
                                             (128, 128))
    for name, forward in (("grouped", forwards.grouped_mm), ("batched", forwards.batched_mm)):
        if name == "batched" and num_tokens > BATCHED_MAX_TOKENS:
            times[name] = f"not timed past {BATCHED_MAX_TOKENS} tokens"
            continue

        def peer(i):
            return forward(inputs.hidden_states[i], inputs.topk_ids[i].long(),
                           inputs.topk_weights[i])

        try:
            with torch.no_grad():
                times[f"{name}_rel_rms"] = f"{relative_rms(peer(0), reference):.3f}"
                times[name] = time_step(peer, VARIANTS, graphable=num_tokens <= GRAPH_MAX_TOKENS)[0]
        except Exception as error:  # a peer that fails reports why, it does not stop the grid
            times[name] = f"{type(error).__name__}: {str(error)[:80]}"
    return times


def scale_bytes(shape: LayerShape, fp8: ExpertWeights) -> int:
    return (fp8.w13_scale.numel() + fp8.w2_scale.numel()) * 4 // shape.num_experts


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("shape,fmt_name", CASES,
                         ids=lambda v: v.name if isinstance(v, LayerShape) else v)
def test_grid_fp8(benchmark, shape, fmt_name, num_tokens, ceilings, record):
    if fmt_name != "block" and num_tokens not in (1, 4, 64, 256, 4096):
        pytest.skip("per-channel and per-tensor run at a few sizes")
    native, fp8 = weights(shape, fmt_name)
    inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
    graphable = num_tokens <= GRAPH_MAX_TOKENS

    def ours(i):
        return run_experts(inputs.hidden_states[i], fp8, inputs.topk_ids[i], inputs.topk_weights[i])

    def bf16(i):
        return fused_experts(inputs.hidden_states[i], native.w13, native.w2, inputs.topk_ids[i],
                             inputs.topk_weights[i])

    reference = bf16(0)
    rel_rms = relative_rms(ours(0), reference)
    assert rel_rms < 0.1, (
        f"{shape.name} {fmt_name} M={num_tokens}: relative RMS {rel_rms:.3f} vs bf16")

    ours_s, mode = time_step(ours, VARIANTS, graphable)
    graph_s = ours_s if graphable else time_graph_replays(capture_graph(ours, VARIANTS), VARIANTS)
    bf16_s, _ = time_step(bf16, VARIANTS, graphable)
    peers = transformers_fp8_times(shape, fp8, inputs, num_tokens, fmt_name, reference)

    bytes_moved = sum(layer_bytes(shape, ids, 1, scale_bytes(shape, fp8))
                      for ids in inputs.topk_ids) / VARIANTS
    flops = layer_flops(shape, num_tokens)
    floor = floor_seconds(bytes_moved, flops, ceilings, fp8=True)
    peer_s = [peers[name] for name in ("grouped", "batched") if isinstance(peers.get(name), float)]
    config = choose_config(num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"), torch.float8_e4m3fn)
    fmt = lambda t: f"{t * 1e6:.1f}" if isinstance(t, float) else "-"  # noqa: E731
    record(TABLE, dict(
        shape=shape.name, format=fmt_name, M=num_tokens, ours_us=f"{ours_s * 1e6:.1f}", timing=mode,
        floor_us=f"{floor * 1e6:.1f}", floor_frac=f"{floor / ours_s:.2f}",
        graph_us=f"{graph_s * 1e6:.1f}",
        graph_frac=f"{floor / graph_s:.2f}",
        bound=("memory" if bytes_moved / ceilings.bandwidth >= flops / ceilings.fp8_matmul_flops
               else "compute"),
        bf16_us=f"{bf16_s * 1e6:.1f}", vs_bf16=f"{bf16_s / ours_s:.2f}x",
        tf_fp8_grouped_us=fmt(peers["grouped"]), tf_fp8_batched_us=fmt(peers["batched"]),
        tf_rel_rms=peers.get("grouped_rel_rms", "-"),
        vs_tf_fp8=f"{min(peer_s) / ours_s:.2f}x" if peer_s else "not run",
        rel_rms_vs_bf16=f"{rel_rms:.3f}", config=config.describe(),
    ))
    benchmark.extra_info.update(dict(
        shape=shape.name, format=fmt_name, num_experts=shape.num_experts, top_k=shape.top_k,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_tokens=num_tokens,
        dtype="float8_e4m3fn", backend="triton", timing=mode, ours_s=ours_s, graph_s=graph_s,
        floor_s=floor,
        roofline_fraction=floor / ours_s, bf16_s=bf16_s, transformers_fp8=str(peers),
        config=config.describe(),
        fp8_matmul_flops=ceilings.fp8_matmul_flops,
    ))
    if graphable:
        graph = capture_graph(ours, VARIANTS)
        benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=20,
                           warmup_rounds=2)
    else:
        benchmark.pedantic(lambda: (ours(0), torch.cuda.synchronize()), rounds=5, warmup_rounds=1)
