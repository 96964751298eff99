"""Decode (M <= 16) designs in one GPU run: the two GEMMs (chained by PDL) and the persistent
one-launch decode kernel with decode_config's tiles and a few others; each grid shape, bf16 and
FP8 block-128, CUDA-graph replays over rotated inputs (weights from HBM), as fractions of the
byte floor, each variant's relative difference from the two GEMMs' output. Then a per-kernel
breakdown (torch.profiler over graph replays) at Qwen3 M=1.

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


def variants(config, decode) -> dict:
    """name -> config: choose_config's two GEMMs; decode_config's kernel, then its tiles varied."""
    d = decode.decode
    out = {"two-GEMM": config, "decode": decode}
    for name, change in (("stages 3", dict(num_stages=3)),
                         ("block_n 128 w8", dict(block_n=128, num_warps=8, num_stages=3)),
                         ("block_h 128 w8", dict(block_h=128, num_warps=8, num_stages=3))):
        out[f"decode {name}"] = replace(decode, decode=replace(d, **change))
    return out


def timed(shape, weights, inputs, config, replays):
    """(seconds a call, the first input's output)"""
    pipeline._PLANS = type(pipeline._PLANS)()  # a fresh cache per variant

    def step(i):
        return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                           inputs.topk_weights[i], config=config)

    first = step(0).float()
    return time_graph_replays(capture_graph(step, VARIANTS), VARIANTS, replays=replays), first


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
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    lines = [f"B = {ceilings.bandwidth / 1e12:.2f} TB/s", "",
             "| shape | format | M | variant | config | us | floor us | of floor | vs two-GEMM "
             "| difference |", "|---|---|---|---|---|---|---|---|---|---|"]
    breakdown = []
    with torch.no_grad():
        for name in args.shapes.split(","):
            shape = GRID_SHAPES[name]
            native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
            formats = {"bf16": native,
                       "fp8-block": native.to_format(WeightFormat.fp8_block(128, 128))}
            for num_tokens in map(int, args.tokens.split(",")):
                inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", VARIANTS)
                for fmt, weights in formats.items():
                    fp8 = fmt != "bf16"
                    sizes = (num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                             shape.intermediate_size, device,
                             torch.float8_e4m3fn if fp8 else torch.bfloat16)
                    chosen, decode = choose_config(*sizes), decode_config(*sizes)
                    floor = floor_seconds(layer_bytes(shape, inputs.topk_ids[0], 1 if fp8 else 2),
                                          layer_flops(shape, num_tokens), ceilings, fp8)
                    base = None
                    for variant, config in variants(chosen, decode).items():
                        if args.variants and variant not in args.variants.split(","):
                            continue
                        try:
                            seconds, first = timed(shape, weights, inputs, config, args.replays)
                        except Exception as error:  # a variant that does not compile: say so
                            print(f"{name} M={num_tokens} {fmt} {variant}: {error!r}"[:300])
                            lines.append(f"| {name} | {fmt} | {num_tokens} | {variant} | "
                                         f"{config.describe()} | failed |  |  |  |  |")
                            continue
                        base = (seconds, first) if base is None else base
                        difference = ((first - base[1]).norm() / base[1].norm()).item()
                        row = dict(shape=name, format=fmt, M=num_tokens, variant=variant,
                                   config=config.describe(), us=round(seconds * 1e6, 1),
                                   floor_us=round(floor * 1e6, 1), difference=difference)
                        print(json.dumps(row), flush=True)
                        lines.append(f"| {name} | {fmt} | {num_tokens} | {variant} | "
                                     f"{row['config']} | {row['us']} | {row['floor_us']} | "
                                     f"{floor / seconds:.2f} | {seconds / base[0]:.3f} | "
                                     f"{difference:.1e} |")
                    if name == "Qwen3-30B-A3B" and num_tokens == 1:
                        for variant in ("two-GEMM", "decode"):
                            config = variants(chosen, decode)[variant]
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
