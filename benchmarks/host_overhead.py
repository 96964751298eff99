"""Host (CPU) time per call of each stage, on a problem too small to keep the GPU busy.

Eager prefill-sized calls are timed with do_bench, which starts the clock before the call is
launched: when launching takes longer than the GPU work, the host is what gets measured. This
script measures that host time directly (wall time of many un-synchronised calls on a tiny
layer) and profiles where it goes.

    python benchmarks/host_overhead.py
"""
import cProfile
import pstats
import time

import torch

from moe_triton import SILU_AND_MUL, GemmConfig, RoutingSpec, expand, expert_gemm, finalize, fused_experts, route
from moe_triton.tools.bench import LayerShape, random_experts, random_inputs

TINY = LayerShape("tiny", num_experts=8, top_k=2, hidden_size=128, intermediate_size=128)
CALLS = 300


def host_us(fn) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def main():
    shape, T = TINY, 64
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    logits = torch.randn(T, shape.num_experts, device="cuda")
    layout = expand(ids, shape.num_experts, 128)
    h = torch.randn(layout.max_rows, shape.intermediate_size, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(layout.max_rows, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    tiles = dict(block_m=128, block_n=128, block_c=64, num_warps=8, num_stages=4)
    cases = {
        "torch.empty (reference point)": lambda: torch.empty(T, shape.hidden_size, device="cuda"),
        "route (1 launch)": lambda: route(logits, RoutingSpec(shape.top_k)),
        "expand (3 launches)": lambda: expand(ids, shape.num_experts, 128),
        "expert_gemm up, TMA weights": lambda: expert_gemm(x, w13, layout, GemmConfig(**tiles, tma_weights=True),
                                                           gather=True, activation=SILU_AND_MUL),
        "expert_gemm up, pointer weights": lambda: expert_gemm(x, w13, layout, GemmConfig(**tiles), gather=True,
                                                               activation=SILU_AND_MUL),
        "expert_gemm down, TMA weights": lambda: expert_gemm(h, w2, layout, GemmConfig(**tiles, tma_weights=True),
                                                             gather=False),
        "finalize (1 launch)": lambda: finalize(y, weights, layout),
        "fused_experts (whole layer)": lambda: fused_experts(x, w13, w2, ids, weights),
    }
    for name, fn in cases.items():
        print(f"{name:36s} {host_us(fn):8.1f} us host per call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        fused_experts(x, w13, w2, ids, weights)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
