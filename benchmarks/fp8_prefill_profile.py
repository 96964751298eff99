"""Why FP8 prefill is no faster than bf16 (issue 13): per-stage GPU times of the Qwen3-30B-A3B
layer at large M in bf16 and in FP8 block / per-channel, each stage's rate against the tensor-core
ceiling, and the same FP8 kernels with the per-step float32 promotion taken out.

The FP8 expert GEMM starts a fresh tensor-core sum every C step and adds it to a float32 accumulator
(_expert_gemm_kernels._step: Hopper's FP8 accumulation drifts without it). `--variant unpromoted`
replaces _step, for this process only, by one that accumulates in the tensor core across the whole C
loop (tl.dot(a, w, acc)): the time difference is what the promotion costs. It is a timing experiment
only: it drops every per-step scale, which per-channel weights do not have but the down GEMM's input
(quantized per row and BLOCK_N group in the up GEMM's epilogue) does, so its output is wrong
(rel_rms ~140, printed) while its instruction stream is the promoted one's minus the promotion. Per-
channel only: block scales change every step.

    python benchmarks/fp8_prefill_profile.py --variant promoted --out a.md
    python benchmarks/fp8_prefill_profile.py --variant unpromoted --out b.md
"""
import argparse
import importlib
import sys

import torch
import triton
import triton.language as tl
from measure import stage_times

from moe_triton import ExpertWeights, WeightFormat, run_experts
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import (
    QWEN3_30B_A3B,
    layer_flops,
    random_experts,
    random_inputs,
    time_graph_replays,
)

VARIANTS = 4
TOKENS = (1024, 4096, 16384)


@triton.jit
def _unpromoted_step(a, w, acc, a_step_scale, w_step_scale, FP8: tl.constexpr,
                     STEP_SCALED: tl.constexpr, IEEE_FP32: tl.constexpr):
    """The tensor core's own accumulation across all C steps (no per-step float32 promotion)."""
    return tl.dot(a, w, acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=("promoted", "unpromoted"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    formats = {"bf16": None, "fp8-block": WeightFormat.fp8_block(128, 128),
               "fp8-channel": WeightFormat.fp8_channel()}
    if args.variant == "unpromoted":
        # Before the first compile: the kernel resolves _step in its module's globals then.
        importlib.import_module("moe_triton._expert_gemm_kernels")._step = _unpromoted_step
        # block scales change per step: they need a promotion
        formats = {"fp8-channel": formats["fp8-channel"]}

    shape = QWEN3_30B_A3B
    native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    lines = [f"# FP8 prefill profile, variant {args.variant}", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}", "",
             "| format | M | graph_us | up_us | down_us | expand_us | finalize_us | other_us "
             "| up_TFLOPs | down_TFLOPs | rel_rms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, fmt in formats.items():
        weights = native if fmt is None else native.to_format(fmt)
        for num_tokens in TOKENS:
            inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)

            def step(i, weights=weights, inputs=inputs):
                return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                                   inputs.topk_weights[i])

            reference = run_experts(inputs.hidden_states[0], native, inputs.topk_ids[0],
                                    inputs.topk_weights[0])
            out = step(0)
            rel = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            graph_s = time_graph_replays(capture_graph(step, VARIANTS), VARIANTS)
            stages = stage_times(step, VARIANTS)
            # 2 * M * K * (2I * H + H * I): the up GEMM is 2/3 of it
            flops = layer_flops(shape, num_tokens)
            up_tflops = flops * 2 / 3 / stages["up"] / 1e12
            down_tflops = flops / 3 / stages["down"] / 1e12
            lines.append(f"| {name} | {num_tokens} | {graph_s * 1e6:.1f} | "
                         f"{stages['up'] * 1e6:.1f} | "
                         f"{stages['down'] * 1e6:.1f} | {stages.get('expand', 0) * 1e6:.1f} | "
                         f"{stages.get('finalize', 0) * 1e6:.1f} | "
                         f"{stages.get('other', 0) * 1e6:.1f} | "
                         f"{up_tflops:.0f} | {down_tflops:.0f} | {rel:.3f} |")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
