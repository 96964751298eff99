"""Decode (M <= 16) designs in one GPU run: the two GEMMs chained by PDL or not, and the
one-kernel decode path (the L2 prefetch this probe once also compared was removed); each grid
shape, bf16 and FP8 block-128, CUDA-graph replays over rotated inputs (weights from HBM), as
fractions of the byte floor. Then a per-kernel breakdown (torch.profiler over graph replays) at
Qwen3 M=1.

    python benchmarks/decode_probe.py --out decode.md      # on the GPU machine
"""
import argparse
import collections
import json
from dataclasses import replace

import torch

import moe_triton.pipeline as pipeline
from moe_triton import (
    ExpertWeights,
    WeightFormat,
    choose_config,
    decode_config,
    run_experts,
)
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

TOKENS = (1, 2, 4, 8, 16)
VARIANTS = 4


def variants(config, decode, fp8: bool) -> dict:
    """name -> config: choose_config's two GEMMs (at decode the second a PDL dependent), without
    PDL; the decode kernel's slice widths (FP8: x quantized by the quantize stage, measured
    faster than in the kernel)."""
    out = {"two-GEMM": config,
           "two-GEMM no PDL": replace(config, down=replace(config.down, dependent=False))}
    for block_n in (64, 128):
        kernel = replace(decode.decode, block_n=block_n, quantize_input=not fp8)
        out[f"decode BN{block_n}"] = replace(decode, decode=kernel)
    return out


def timed(shape, weights, inputs, config, replays):
    pipeline._PLANS = type(pipeline._PLANS)()  # a fresh cache per variant

    def step(i):
        return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                           inputs.topk_weights[i], config=config)

    return time_graph_replays(capture_graph(step, VARIANTS), VARIANTS, replays=replays)


def kernel_breakdown(shape, weights, inputs, config) -> list[str]:
    pipeline._PLANS = type(pipeline._PLANS)()

    def step(i):
        return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                           inputs.topk_weights[i], config=config)

    graph = capture_graph(step, VARIANTS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time / (20 * VARIANTS)
    return [f"{us:7.1f} us  {name}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_probe.md")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(GRID_SHAPES))
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    lines = [f"B = {ceilings.bandwidth / 1e12:.2f} TB/s", "",
             "| shape | format | M | variant | config | us | floor us | of floor |",
             "|---|---|---|---|---|---|---|---|"]
    breakdown = []
    with torch.no_grad():
        for name in args.shapes.split(","):
            shape = GRID_SHAPES[name]
            native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
            formats = {"bf16": native,
                       "fp8-block": native.to_format(WeightFormat.fp8_block(128, 128))}
            for num_tokens in TOKENS:
                inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
                for fmt, weights in formats.items():
                    fp8 = fmt != "bf16"
                    sizes = (num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                             shape.intermediate_size, device,
                             torch.float8_e4m3fn if fp8 else torch.bfloat16)
                    chosen, decode = choose_config(*sizes), decode_config(*sizes)
                    floor = floor_seconds(layer_bytes(shape, inputs.topk_ids[0], 1 if fp8 else 2),
                                          layer_flops(shape, num_tokens), ceilings, fp8)
                    for variant, config in variants(chosen, decode, fp8).items():
                        seconds = timed(shape, weights, inputs, config, args.replays)
                        row = dict(shape=name, format=fmt, M=num_tokens, variant=variant,
                                   config=config.describe(), us=round(seconds * 1e6, 1),
                                   floor_us=round(floor * 1e6, 1))
                        print(json.dumps(row), flush=True)
                        lines.append(f"| {name} | {fmt} | {num_tokens} | {variant} | "
                                     f"{row['config']} | {row['us']} | {row['floor_us']} | "
                                     f"{floor / seconds:.2f} |")
                    if name == "Qwen3-30B-A3B" and num_tokens == 1:
                        for variant in ("two-GEMM", "two-GEMM no PDL", "decode BN64"):
                            config = variants(chosen, decode, fp8)[variant][0]
                            breakdown += [f"### {fmt} M=1 {variant}: {config.describe()}", "",
                                          "```", *kernel_breakdown(shape, weights, inputs,
                                                                   config), "```", ""]
                torch.cuda.empty_cache()
            del native, formats
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("\n".join(lines + ["", "## Kernels at Qwen3-30B-A3B M=1 (graph replay)", ""]
                          + breakdown) + "\n")


if __name__ == "__main__":
    main()
