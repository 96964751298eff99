"""Host (CPU) time of one eager layer call, and what it costs the GPU (issue 15, part 1).

The host time of a call is measured alone: calls are timed one by one right after a sync, a few
dozen in a row, so the launch queue never fills and the GPU never holds the host back (their GPU
work is queued, not waited for). Beside it: the eager call and the same call replayed from a CUDA
graph, both by do_bench (median, L2 flushed), on the Qwen3-30B-A3B layer; then the host time of
each stage's launcher and a profile of one token count.

    python benchmarks/host_overhead.py [--out docs/grid/host-overhead-<commit>.md]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.testing import do_bench

import moe_triton
from moe_triton import SILU_AND_MUL, ExpertWeights, choose_config, fused_experts, pipeline
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import QWEN3_30B_A3B, random_experts, random_inputs

TOKENS = (1, 4, 16, 64, 256)
CALLS = 30


def host_us(fn, rounds: int = 3) -> float:
    """Host time of one call, with the GPU never the bottleneck: the median of CALLS calls timed one
    by one, the lowest of `rounds` such medians (this host's timings drift by tens of µs)."""
    medians = []
    for _ in range(rounds):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(CALLS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def jit_launches_per_call(fn) -> float:
    """Launches that went through Triton's JIT (not a BoundLaunch's direct path) per call, after
    warm-up."""
    fn()
    calls = []
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        for _ in range(10):
            fn()
    finally:
        JITFunction.run = run
    return len(calls) / 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    lines = [f"# Host time of an eager layer call, {shape.name} (E={shape.num_experts}, "
             f"K={shape.top_k}, H={shape.hidden_size}, I={shape.intermediate_size}), bf16",
             f"torch {torch.__version__}, triton {triton.__version__}, "
             f"{torch.cuda.get_device_name()}", "",
             "| M | host µs per call | JIT launches per call | eager do_bench µs | graph replay µs "
             "| eager / graph | config |",
             "|---|---|---|---|---|---|---|"]
    for T in TOKENS:
        inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
        x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]

        def call():
            return fused_experts(x, w13, w2, ids, weights)

        host = host_us(call)
        jit = jit_launches_per_call(call)
        eager = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
        graph = capture_graph(lambda i: call(), 1)
        replay = do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                               shape.intermediate_size, x.device)
        lines.append(f"| {T} | {host:.1f} | {jit:g} | {eager:.1f} | {replay:.1f} | "
                     f"{eager / replay:.2f} | {config.describe()} |")
        print(lines[-1], flush=True)
    lines += ["", "Host time of the parts of one planned call (pipeline.LayerPlan), M = 64:", ""]
    inputs = random_inputs(shape, 64, torch.bfloat16, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    fused_experts(x, w13, w2, ids, weights)
    experts = ExpertWeights(w13, w2)
    signature = pipeline._call_signature(x, experts, ids, weights, SILU_AND_MUL, None, None)
    plan = pipeline._PLANS.get(signature)
    layout = plan.expand(ids)
    h, _ = plan.up(x, w13, layout)
    y, _ = plan.down(h, w2, layout)
    parts = {
        "torch.empty (reference point)": lambda: torch.empty(64, shape.hidden_size, device="cuda"),
        "ExpertWeights(w13, w2) (fused_experts builds one per call)":
            lambda: ExpertWeights(w13, w2),
        "the call's signature and plan lookup":
            lambda: pipeline._PLANS.get(pipeline._call_signature(
                x, experts, ids, weights, SILU_AND_MUL, None, None)),
        "expand (1 allocation, 3 launches)": lambda: plan.expand(ids),
        "expert GEMM up (1 allocation, 1 launch, TMA)": lambda: plan.up(x, w13, layout),
        "expert GEMM down (1 allocation, 1 launch, TMA)": lambda: plan.down(h, w2, layout),
        "finalize (1 allocation, 1 launch)": lambda: plan.finalize(y, weights, layout, None),
        "the whole call, fused_experts": lambda: fused_experts(x, w13, w2, ids, weights),
        "the same finalize through the JIT (finalize())":
            lambda: moe_triton.finalize.finalize(y, weights, layout),
    }
    for name, fn in parts.items():
        lines.append(f"- {name}: {host_us(fn):.1f} µs")
        print(lines[-1], flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        fused_experts(x, w13, w2, ids, weights)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    lines += ["", f"cProfile of {CALLS} planned calls at M = 64 (profiling inflates Python time):",
              "", "```", text.getvalue().strip(), "```"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
