"""The expert layer vs transformers' own experts implementations, beside the roofline floor.

Decode sizes are timed from CUDA-graph replays (ours and batched_mm); transformers' grouped_mm
cannot be captured (its offsets feed a host-side shape) and is timed eagerly with do_bench, as are
prefill sizes. Four input sets rotate so weights come from HBM.
"""
import functools

import pytest
import torch
from measure import transformers_experts

from moe_triton import choose_config, fused_experts, fused_experts_torch
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import (
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    floor_seconds,
    layer_bytes,
    layer_flops,
    random_experts,
    random_inputs,
    time_step,
)

VARIANTS = 4
DECODE = [1, 8, 32, 128]
PREFILL = [2048, 8192]
BATCHED_MM_MAX_BYTES = 8 * 2**30  # batched_mm gathers one weight copy per (token, slot)


@functools.lru_cache(maxsize=1)
def weights(shape):
    return random_experts(shape, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", DECODE + PREFILL)
@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL_8X7B], ids=lambda s: s.name)
def test_layer(benchmark, shape, num_tokens, ceilings, record):
    w13, w2 = weights(shape)
    inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
    decode = num_tokens <= 256

    def ours(i):
        return fused_experts(inputs.hidden_states[i], w13, w2, inputs.topk_ids[i],
                             inputs.topk_weights[i])

    out = ours(0).float()
    ref = fused_experts_torch(inputs.hidden_states[0], w13, w2, inputs.topk_ids[0],
                              inputs.topk_weights[0])
    rel_err = ((out - ref).norm() / ref.norm()).item()
    assert rel_err < 1e-2, f"bf16 relative error {rel_err:.2e}"

    ours_s, ours_mode = time_step(ours, VARIANTS, graphable=decode)
    peers = {}
    for impl in ("grouped_mm", "batched_mm"):
        gathered = num_tokens * shape.top_k * w13[0].numel() * 3 // 2 * 2
        if impl == "batched_mm" and gathered > BATCHED_MM_MAX_BYTES:
            peers[impl] = (float("nan"), f"skipped: gathers {gathered / 2**30:.0f} GiB")
            continue
        experts = transformers_experts(shape, w13, w2, impl)
        peer = lambda i: experts(inputs.hidden_states[i], inputs.topk_ids[i].long(),  # noqa: E731
                                 inputs.topk_weights[i])
        with torch.no_grad():
            peers[impl] = time_step(peer, VARIANTS, graphable=decode and impl == "batched_mm")

    bytes_moved = sum(layer_bytes(shape, ids) for ids in inputs.topk_ids) / VARIANTS
    flops = layer_flops(shape, num_tokens)
    floor = floor_seconds(bytes_moved, flops, ceilings)
    best_peer = min(t for t, _ in peers.values() if t == t)
    config = choose_config(num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"), torch.bfloat16)
    row = dict(
        shape=shape.name, T=num_tokens, ours_us=f"{ours_s * 1e6:.1f} ({ours_mode})",
        floor_us=f"{floor * 1e6:.1f}", floor_frac=f"{floor / ours_s:.2f}",
        bound=("memory" if bytes_moved / ceilings.bandwidth >= flops / ceilings.matmul_flops
               else "compute"),
        GBps=f"{bytes_moved / ours_s / 1e9:.0f}", TFLOPs=f"{flops / ours_s / 1e12:.0f}",
        grouped_mm_us=f"{peers['grouped_mm'][0] * 1e6:.1f} ({peers['grouped_mm'][1]})",
        batched_mm_us=(f"{peers['batched_mm'][0] * 1e6:.1f} ({peers['batched_mm'][1]})"
                       if peers["batched_mm"][0] == peers["batched_mm"][0]
                       else peers["batched_mm"][1]),
        speedup_vs_best_peer=f"{best_peer / ours_s:.2f}x", rel_err=f"{rel_err:.1e}",
        config=f"{config.layout.value} BM{config.block_m} "
               f"up BN{config.up.block_n}/BC{config.up.block_c} "
               f"down BN{config.down.block_n}/BC{config.down.block_c}"
               f"{' tma' if config.up.tma_weights else ''}",
    )
    record("expert layer vs transformers (bf16)", row)
    benchmark.extra_info.update(dict(
        shape=shape.name, num_experts=shape.num_experts, top_k=shape.top_k,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_tokens=num_tokens, dtype="bfloat16", backend="triton",
        timing=ours_mode, ours_s=ours_s, floor_s=floor, roofline_fraction=floor / ours_s,
        grouped_mm_s=peers["grouped_mm"][0], batched_mm_s=peers["batched_mm"][0],
    ))
    if decode:
        graph = capture_graph(ours, VARIANTS)
        benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=30,
                           warmup_rounds=3)
    else:
        benchmark.pedantic(lambda: (ours(0), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)
