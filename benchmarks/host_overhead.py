"""Host (CPU) time of one eager layer call, and what it costs the GPU (issue 15, part 1).

The host time of a call is measured alone: calls are timed one by one right after a sync, a few
dozen in a row, so the launch queue never fills and the GPU never holds the host back (their GPU
work is queued, not waited for). Beside it: the eager call and the same call replayed from a CUDA
graph, both by do_bench (median, L2 flushed), on the Qwen3-30B-A3B layer; then the host time of
each stage's launcher and a profile of one token count. The drop-in (issue 29): the same layer as
transformers calls it, a Qwen3MoeExperts module's forward with `experts_implementation`
"moe_triton" (bf16), its FP8Experts (block-128, quantized by transformers) on "moe_triton", and
transformers' own "grouped_mm" beside them; int64 ids, as transformers' router returns them.

    python benchmarks/host_overhead.py [--out docs/grid/host-overhead-<commit>.md]
"""
import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton
from triton.runtime.jit import JITFunction
from triton.testing import do_bench

import moe_triton
from moe_triton import SILU_AND_MUL, ExpertWeights, choose_config, fused_experts, pipeline
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import QWEN3_30B_A3B, random_experts, random_inputs

sys.path.insert(0, os.path.dirname(__file__))
from measure import transformers_experts, transformers_fp8_experts  # noqa: E402

TOKENS = (1, 4, 16, 64, 256)
CALLS = 30
ROUNDS = 5


@torch.no_grad()
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


@contextlib.contextmanager
def triton_launcher():
    """Plans built inside launch through the compiled kernel's own launcher (Triton's Python
    wrapper, which encodes descriptors at every launch): the direct path before issue 29."""
    real = moe_triton.launch._raw_launcher
    pipeline._PLANS._plans.clear()
    moe_triton.launch._raw_launcher = lambda compiled, num_args: None
    try:
        yield
    finally:
        moe_triton.launch._raw_launcher = real
        pipeline._PLANS._plans.clear()


def c_launch(launch, **tensors):
    """The bound launch's C launcher called with its arguments laid out: Triton's C function and
    the driver call, none of our Python."""
    direct = launch._direct
    values = direct._values(tensors)
    values[3] = triton.runtime.driver.active.get_current_stream(direct.device)
    return lambda: direct._launch(*values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    lines = [f"# Host time of an eager layer call, {shape.name} (E={shape.num_experts}, "
             f"K={shape.top_k}, H={shape.hidden_size}, I={shape.intermediate_size}), bf16",
             f"commit {os.environ.get('MOE_TRITON_COMMIT', 'unknown')}, "
             f"torch {torch.__version__}, triton {triton.__version__}, "
             f"{torch.cuda.get_device_name()}", "",
             "Host µs per call: fused_experts through Triton's own launcher and through its C "
             "function (launch.py); the drop-in (bf16, FP8); transformers' grouped_mm.",
             "",
             "| M | fused_experts, Triton's launcher | fused_experts | drop-in bf16 | drop-in FP8 "
             "| grouped_mm "
             "| JIT launches per call | eager do_bench µs | graph replay µs | eager / graph "
             "| config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ours = transformers_experts(shape, w13, w2, "moe_triton")
    grouped = transformers_experts(shape, w13, w2, "grouped_mm")
    fp8 = transformers_fp8_experts(ours, ours.config)  # shares ours' config: "moe_triton"
    for T in TOKENS:
        inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
        x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]

        def call():
            return fused_experts(x, w13, w2, ids, weights)

        long_ids = ids.long()
        columns = {"before": (call, triton_launcher), "after": (call, contextlib.nullcontext),
                   **{name: (lambda experts=experts: experts(x, long_ids, weights),
                             contextlib.nullcontext)
                      for name, experts in (("bf16", ours), ("fp8", fp8), ("grouped_mm", grouped))}}
        best = dict.fromkeys(columns, float("inf"))
        for _ in range(ROUNDS):  # the columns in turn: this host's speed drifts between rounds
            for name, (fn, context) in columns.items():
                with context():
                    best[name] = min(best[name], host_us(fn, rounds=1))
        before, host = best["before"], best["after"]
        drop_in = best
        jit = jit_launches_per_call(call)
        eager = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
        graph = capture_graph(lambda i: call(), 1)
        replay = do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                               shape.intermediate_size, x.device)
        lines.append(f"| {T} | {before:.1f} | {host:.1f} | {drop_in['bf16']:.1f} | "
                     f"{drop_in['fp8']:.1f} | {drop_in['grouped_mm']:.1f} | {jit:g} | "
                     f"{eager:.1f} | {replay:.1f} | "
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
        "finalize's launcher alone (arguments laid out)":
            c_launch(plan.finalize.launch, y_ptr=y, topk_weights_ptr=weights,
                            pair_to_row_ptr=layout.pair_to_row, topk_ids_ptr=layout.topk_ids,
                            out_ptr=torch.empty_like(x)),
    }
    for name, fn in parts.items():
        lines.append(f"- {name}: {host_us(fn):.1f} µs")
        print(lines[-1], flush=True)
    inputs = random_inputs(shape, 1, torch.bfloat16, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0].long(), inputs.topk_weights[0]
    for name, experts in (("bf16", ours), ("FP8", fp8)):
        with torch.no_grad():
            experts(x, ids, weights)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(CALLS):
                experts(x, ids, weights)
            profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        lines += ["", f"cProfile of {CALLS} {name} drop-in calls at M = 1 (profiling inflates "
                  "Python time):", "", "```", text.getvalue().strip(), "```"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
