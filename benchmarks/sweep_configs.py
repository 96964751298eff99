"""Sweep the expert GEMMs' tiles per case, and profile where a decode step's time goes.

Not a test: a script for the GPU machine that informs `moe_triton.config.choose_config`.
    python benchmarks/sweep_configs.py > sweep.txt
    python benchmarks/sweep_configs.py --split > sweep-split.txt   (decode, grid shapes)
    python benchmarks/sweep_configs.py --decode > sweep-decode.txt
        (M = 1 and 4, grid shapes, planned)
    python benchmarks/sweep_configs.py --block-m > sweep-block-m.txt
        (16-64 rows per expert, whole layer)
Each GEMM is timed alone (do_bench median, L2 flushed) on a layout built once per case.
"""
import torch
from triton.testing import do_bench

from moe_triton import SILU_AND_MUL, GemmConfig, LayoutKind, fused_experts, per_pair_layout
from moe_triton.expand import expand
from moe_triton.expert_gemm import expert_gemm
from moe_triton.tools.bench import (
    DEEPSEEK_V3,
    E64_K4,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    random_experts,
    random_inputs,
)

# (block_n, block_c, num_stages, num_warps, tma_weights)
DECODE_UP = [(64, 256, 3, 4, False), (64, 256, 3, 4, True), (64, 128, 4, 4, True),
             (128, 128, 4, 4, True)]
DECODE_DOWN = [(32, 128, 4, 4, False), (32, 128, 4, 4, True), (64, 128, 4, 4, True),
               (128, 128, 4, 4, False), (128, 128, 4, 4, True)]
PREFILL_UP = [(128, 64, 4, 8, False), (128, 64, 4, 8, True), (128, 64, 3, 8, True),
              (128, 32, 4, 8, True)]
PREFILL_DOWN = [(256, 64, 3, 8, False), (256, 64, 3, 8, True), (256, 64, 4, 8, True),
                (128, 64, 4, 8, True)]
CASES = [(QWEN3_30B_A3B, [1, 8, 128, 2048, 8192]), (MIXTRAL_8X7B, [1, 8, 128, 2048, 8192])]


def time_us(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def sweep_case(shape, T, w13, w2):
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
    x, ids = inputs.hidden_states[0], inputs.topk_ids[0]
    if T <= 256:
        sorted_bm = 16 if T * shape.top_k <= 16 * shape.num_experts else 32
        kinds = [(LayoutKind.PER_PAIR, 16)] if T == 1 else [(LayoutKind.SORTED, sorted_bm)]
        ups, downs = DECODE_UP, DECODE_DOWN
    else:
        kinds = [(LayoutKind.SORTED, 128)]
        ups, downs = PREFILL_UP, PREFILL_DOWN
    for kind, bm in kinds:
        per_pair = kind is LayoutKind.PER_PAIR
        layout = (per_pair_layout(ids, shape.num_experts, bm) if per_pair
                  else expand(ids, shape.num_experts, bm))
        h = expert_gemm(x, w13, layout, GemmConfig(bm, 64, 64), gather=True,
                        activation=SILU_AND_MUL)
        for name, tiles, run in (
            ("up", ups,
             lambda c: expert_gemm(x, w13, layout, c, gather=True, activation=SILU_AND_MUL)),
            ("down", downs, lambda c: expert_gemm(h, w2, layout, c, gather=False)),
        ):
            results = []
            for bn, bc, stages, warps, tma in tiles:
                config = GemmConfig(bm, bn, bc, group_m=8 if bm >= 64 else 1, num_warps=warps,
                                    num_stages=stages, tma_weights=tma)
                try:
                    results.append((time_us(lambda: run(config)), config))
                except Exception as error:  # out of shared memory etc.: report and go on
                    print(f"  {name} {config}: {type(error).__name__}")
            results.sort(key=lambda r: r[0])
            best = ", ".join(f"{t:.1f}us BN{c.block_n}/BC{c.block_c}/s{c.num_stages}/w{c.num_warps}"
                             f"{'/tma' if c.tma_weights else ''}" for t, c in results)
            print(f"{shape.name} T={T} {kind.value} BM{bm} {name}: {best}", flush=True)


# Split-C (split-K) of the second GEMM at decode sizes: the whole layer per split, timed as
# CUDA-graph replays over four routings (a host-side timer would time Python launches at these
# sizes, not the GPU). The first GEMM is never split: docs/sweep-split-k-2026-11-29.txt measured it
# slower everywhere.
DOWN_SPLITS = [1, 2, 3, 4, 8]
SPLIT_CASES = [(shape, [1, 4, 16]) for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4)]


def sweep_down_split(shape, T, w13, w2):
    from moe_triton import choose_config
    from moe_triton.graphs import capture_graph
    from moe_triton.tools.bench import time_graph_replays

    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=4)
    results = []
    for splits in DOWN_SPLITS:
        config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                               shape.intermediate_size, torch.device("cuda"), down_split=splits)

        def step(i):
            return fused_experts(inputs.hidden_states[i], w13, w2, inputs.topk_ids[i],
                                 inputs.topk_weights[i], config=config)

        try:
            results.append((time_graph_replays(capture_graph(step, 4), 4) * 1e6, config.describe()))
        except Exception as error:  # out of shared memory etc.: report and go on
            print(f"  {splits}: {type(error).__name__}: {str(error)[:100]}")
    results.sort()
    print(f"split {shape.name} T={T}: " + ", ".join(f"{t:.1f}us [{c}]" for t, c in results),
          flush=True)


# One- and four-token decode (issue 15, part 2): tiles around choose_config's, every grid shape,
# each GEMM timed alone through its plan, so that the host's launch cost stays out of the timing.
# (block_n, block_c, num_stages, num_warps); TMA weights and choose_config's split as chosen.
DECODE_UP_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 3, 4), (32, 128, 5, 4),
                   (16, 256, 4, 4), (64, 128, 5, 4), (32, 128, 4, 2), (64, 256, 3, 4)]
DECODE_DOWN_TILES = [(128, 128, 4, 4), (64, 128, 4, 4), (64, 256, 3, 4), (32, 256, 3, 4),
                     (128, 128, 5, 4), (64, 128, 5, 4), (32, 128, 4, 4)]


def sweep_decode(shape, T, w13, w2):
    from dataclasses import replace

    from moe_triton import choose_config
    from moe_triton.expert_gemm import plan_expert_gemm

    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
    x, ids = inputs.hidden_states[0], inputs.topk_ids[0]
    config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, x.device)
    per_pair = config.layout is LayoutKind.PER_PAIR
    layout = (per_pair_layout if per_pair else expand)(ids, shape.num_experts, config.block_m)
    h = expert_gemm(x, w13, layout, config.up, gather=True, activation=SILU_AND_MUL)
    for name, base, tiles, a, w, kwargs in (
        ("up", config.up, DECODE_UP_TILES, x, w13, dict(gather=True, activation=SILU_AND_MUL)),
        ("down", config.down, DECODE_DOWN_TILES, h, w2, dict(gather=False)),
    ):
        results = []
        for bn, bc, stages, warps in tiles:
            tile = replace(base, block_n=bn, block_c=bc, num_stages=stages, num_warps=warps)
            try:
                plan = plan_expert_gemm(a, w, layout, tile, **kwargs)
                results.append((time_us(lambda: plan(a, w, layout)), tile))
            except Exception as error:  # out of shared memory etc.: report and go on
                print(f"  {name} {tile}: {type(error).__name__}")
        chosen = next(t for t, c in results if c == base)
        results.sort(key=lambda r: r[0])
        line = ", ".join(f"{t:.1f}us BN{c.block_n}/BC{c.block_c}/s{c.num_stages}/w{c.num_warps}"
                         f"{f'/S{c.split_c}' if c.split_c > 1 else ''}" for t, c in results)
        print(f"decode {shape.name} T={T} {config.layout.value} {name}: chosen {chosen:.1f}us; "
              f"{line}", flush=True)


# Rows per expert 16-64 (issue 15, part 3): the row tile against the rows each expert really gets.
# The whole layer per block_m (choose_config's tiles otherwise), graph replays over four routings.
BLOCK_M_CASES = [(QWEN3_30B_A3B, [64, 256, 1024]), (MIXTRAL_8X7B, [64, 256]), (DEEPSEEK_V3, [1024]),
                 (E64_K4, [256, 1024])]


def sweep_block_m(shape, T, w13, w2):
    from dataclasses import replace

    from moe_triton import MoEConfig, choose_config
    from moe_triton.graphs import capture_graph
    from moe_triton.tools.bench import time_graph_replays

    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=4)
    chosen = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"))
    counts = torch.bincount(inputs.topk_ids[0].flatten().long(), minlength=shape.num_experts)
    results = []
    for block_m in (16, 32, 64, 128):
        config = MoEConfig(replace(chosen.up, block_m=block_m),
                           replace(chosen.down, block_m=block_m), chosen.layout)

        def step(i):
            return fused_experts(inputs.hidden_states[i], w13, w2, inputs.topk_ids[i],
                                 inputs.topk_weights[i], config=config)

        try:
            results.append((time_graph_replays(capture_graph(step, 4), 4) * 1e6, block_m))
        except Exception as error:  # out of shared memory etc.: report and go on
            print(f"  BM{block_m}: {type(error).__name__}: {str(error)[:100]}")
    print(f"block_m {shape.name} T={T} (rows per expert: mean {counts.float().mean():.1f}, "
          f"max {counts.max()}; chosen BM{chosen.block_m}): "
          + ", ".join(f"BM{b} {t:.1f}us" for t, b in results), flush=True)


DECODE_CASES = [(shape, [1, 4]) for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4)]


def run_sweep(cases, sweep) -> None:
    """sweep(shape, T, w13, w2) for every case, one shape's weights on the GPU at a time."""
    for shape, tokens in cases:
        w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
        for T in tokens:
            sweep(shape, T, w13, w2)
        del w13, w2
        torch.cuda.empty_cache()


def profile_layer(shape, T, w13, w2):
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
    args = (inputs.hidden_states[0], w13, w2, inputs.topk_ids[0], inputs.topk_weights[0])
    for _ in range(3):
        fused_experts(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fused_experts(*args)
        torch.cuda.synchronize()
    print(f"--- {shape.name} T={T}: per-kernel GPU time (us per layer call)")
    for event in prof.key_averages():
        if event.device_time_total > 0:
            print(f"  {event.key[:60]:60s} {event.device_time_total / 10:8.1f}")


if __name__ == "__main__":
    import sys

    modes = {"--block-m": (BLOCK_M_CASES, sweep_block_m), "--decode": (DECODE_CASES, sweep_decode),
             "--split": (SPLIT_CASES, sweep_down_split)}
    for mode, (cases, sweep) in modes.items():
        if mode in sys.argv:
            run_sweep(cases, sweep)
            sys.exit(0)
    for shape, tokens in CASES:
        w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
        if "--profile" in sys.argv:
            for T in (1, 8, 2048):
                profile_layer(shape, T, w13, w2)
        for T in tokens:
            sweep_case(shape, T, w13, w2)
        del w13, w2
