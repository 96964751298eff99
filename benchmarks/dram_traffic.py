"""Grid cases to run under Nsight Compute (DRAM bytes per kernel), or under load to watch clocks.

    ncu --clock-control none
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        python benchmarks/dram_traffic.py Qwen3-30B-A3B:1 Qwen3-30B-A3B:4096
    python benchmarks/dram_traffic.py --sustain 20 Qwen3-30B-A3B:4096   # 20 s of back-to-back calls

Each case warms up (compiles) on a routing of its own, then makes one call on a fresh routing, so
the profiled call reads its weights from HBM; `--sustain` loops the call instead.
"""
import argparse
import time

import torch

from moe_triton import fused_experts
from moe_triton.tools.bench import (
    DEEPSEEK_V3,
    E64_K4,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    random_experts,
    random_inputs,
)

SHAPES = {s.name: s for s in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+", help="SHAPE:M, e.g. Qwen3-30B-A3B:4096")
    parser.add_argument("--sustain", type=float, default=0.0,
                        help="seconds of back-to-back calls per case")
    args = parser.parse_args()
    for case in args.cases:
        name, tokens = case.rsplit(":", 1)
        shape, T = SHAPES[name], int(tokens)
        w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
        inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=2)
        calls = [lambda i=i: fused_experts(inputs.hidden_states[i], w13, w2, inputs.topk_ids[i],
                                           inputs.topk_weights[i]) for i in range(2)]
        calls[0]()
        torch.cuda.synchronize()
        if args.sustain:
            start, count = time.perf_counter(), 0
            while time.perf_counter() - start < args.sustain:
                calls[count % 2]()
                count += 1
            torch.cuda.synchronize()
            print(f"{case}: {count} calls in {time.perf_counter() - start:.1f} s", flush=True)
        else:
            calls[1]()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
