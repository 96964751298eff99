"""A refactor's same-run check: host time of eager layer calls and GPU time of grid points, for
whichever moe_triton is importable, through the public API only (so an old tree runs it too).

Run once per tree, alternating, in one GPU session, from outside the checkout so the import
resolves to the install under test:

    cd /tmp && PYTHONPATH=<tree's install> python <repo>/benchmarks/compare_trees.py --label before
    cd /tmp && python <repo>/benchmarks/compare_trees.py --label after     # the editable install

Each run prints one JSON line per case; compare medians across runs (issue 26: within noise).
"""
import argparse
import json
import statistics
import time

import torch
from triton.testing import do_bench

import moe_triton
from moe_triton import FusedMoE, Placement, RoutingSpec, fused_experts
from moe_triton.tools.bench import MIXTRAL_8X7B, QWEN3_30B_A3B, random_experts, random_inputs

GRID = [(QWEN3_30B_A3B, 1), (QWEN3_30B_A3B, 64), (QWEN3_30B_A3B, 4096), (MIXTRAL_8X7B, 1024)]


def host_us(fn, calls: int = 30, rounds: int = 5) -> float:
    """The lowest of `rounds` medians of `calls` calls timed one by one (the GPU never the
    bottleneck)."""
    medians = []
    for _ in range(rounds):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def qwen3_layer() -> FusedMoE:
    shape = QWEN3_30B_A3B
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
    layer = FusedMoE(E, K, H, I, routing=RoutingSpec(K, renormalize=True),
                     placement=Placement("triton"), dtype=torch.bfloat16, device="cuda")
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    with torch.no_grad():
        layer.gate_up_proj.copy_(w13)
        layer.down_proj.copy_(w2)
        layer.gate_weight.normal_(0, H**-0.5)
    layer.prepare_weights()
    return layer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    source = moe_triton.__file__
    with torch.no_grad():
        layer = qwen3_layer()
        for T in (1, 64):
            x = torch.randn(T, QWEN3_30B_A3B.hidden_size, dtype=torch.bfloat16, device="cuda")
            print(json.dumps({"label": args.label, "case": f"FusedMoE host Qwen3 M={T}",
                              "us": round(host_us(lambda: layer(x)), 1), "source": source}),
                  flush=True)
        for shape, T in GRID:
            w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
            inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
            x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]

            def call():
                return fused_experts(x, w13, w2, ids, weights)

            case = f"{shape.name} M={T}"
            if T == 1:
                print(json.dumps({"label": args.label, "case": f"fused_experts host {case}",
                                  "us": round(host_us(call), 1)}), flush=True)
            gpu = do_bench(call, warmup=50, rep=300, return_mode="median") * 1e3
            print(json.dumps({"label": args.label, "case": f"fused_experts GPU {case}",
                              "us": round(gpu, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
