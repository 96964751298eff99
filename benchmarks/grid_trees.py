"""A kernel change's same-run check: the layer's GPU time at every grid point (4 shapes x 8 token
counts) in bf16 and FP8 block-128, for whichever moe_triton is importable, through the public API
only (so the tree before the change runs it too). Each point is CUDA-graph replays of four calls
over rotated inputs (weights from HBM, no host time), the median of `--replays`.

Run once per tree, alternating, in one GPU session, from outside the checkout:

    cd /tmp && PYTHONPATH=<old tree's install> python <repo>/benchmarks/grid_trees.py --label before
    cd /tmp && python <repo>/benchmarks/grid_trees.py --label after     # the editable install

Prints one JSON line per point: label, shape, format, M, us, floor_us (B, F, F8 measured first).
"""
import argparse
import json

import torch

import moe_triton
from moe_triton import ExpertWeights, WeightFormat, run_experts
from moe_triton.graphs import capture_graph
from moe_triton.tools.bench import (
    GRID_SHAPES,
    floor_seconds,
    layer_bytes,
    layer_flops,
    measure_ceilings,
    random_experts,
    random_inputs,
    time_graph_replays,
)

TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
VARIANTS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--formats", default="bf16,fp8-block")
    parser.add_argument("--max-tokens", type=int, default=max(TOKENS))
    args = parser.parse_args()
    ceilings = measure_ceilings(torch.device("cuda"))
    print(json.dumps({"label": args.label, "source": moe_triton.__file__,
                      "B": ceilings.bandwidth, "F": ceilings.matmul_flops,
                      "F8": ceilings.fp8_matmul_flops}), flush=True)
    with torch.no_grad():
        for shape in GRID_SHAPES.values():
            native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
            formats = {"bf16": native,
                       "fp8-block": native.to_format(WeightFormat.fp8_block(128, 128))}
            formats = {name: formats[name] for name in args.formats.split(",")}
            for num_tokens in (t for t in TOKENS if t <= args.max_tokens):
                inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
                for name, weights in formats.items():
                    def step(i, weights=weights, inputs=inputs):
                        return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                                           inputs.topk_weights[i])

                    seconds = time_graph_replays(capture_graph(step, VARIANTS), VARIANTS,
                                                 replays=args.replays)
                    fp8 = name != "bf16"
                    floor = floor_seconds(layer_bytes(shape, inputs.topk_ids[0], 1 if fp8 else 2),
                                          layer_flops(shape, num_tokens), ceilings, fp8)
                    print(json.dumps({"label": args.label, "shape": shape.name, "format": name,
                                      "M": num_tokens, "us": round(seconds * 1e6, 1),
                                      "floor_us": round(floor * 1e6, 1)}), flush=True)
                torch.cuda.empty_cache()
            del native, formats
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
