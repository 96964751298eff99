"""Sweep the FP8 prefill tiles: the whole layer (block-scaled, 128 x 128) per candidate
configuration.

Not a test: a script for the GPU machine that informs the FP8 rules of `moe_triton.config`. The
first FP8 grid (docs/PERFORMANCE.md) found the prefill tiles inherited from bf16 (128-row blocks, a
fused gate tile of 128 columns: two 128 x 128 float32 accumulators, plus a third for the FP8 step
promotion) 2-3x slower than our bf16 layer: register spills. Each candidate here is timed with
`triton.testing.do_bench` (median, L2 flushed), beside the FP8 floor of the same run.

    python benchmarks/sweep_fp8.py > docs/sweep-fp8-prefill.txt
"""
import torch
from triton.testing import do_bench

from moe_triton import (
    ExpertWeights,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    WeightFormat,
    choose_config,
    run_experts,
)
from moe_triton.tools.bench import (
    DEEPSEEK_V3,
    E64_K4,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    floor_seconds,
    layer_bytes,
    layer_flops,
    measure_ceilings,
    random_experts,
    random_inputs,
)


def candidates(shape, T) -> dict[str, MoEConfig]:
    # (block_m, up block_n, down block_n, down block_c, warps): the second GEMM's steps must divide
    # the first GEMM's block_n (its output scale groups), and every step must divide the 128-wide
    # blocks
    rules = {"BM128 up128 down256 (bf16 rule)": (128, 128, 256, 128, 8),
             "BM128 up64 down128": (128, 64, 128, 64, 8),
             "BM64 up128 down256": (64, 128, 256, 128, 8),
             "BM64 up128 down128": (64, 128, 128, 128, 4)}
    configs = {"chosen": choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                                       shape.intermediate_size, torch.device("cuda"),
                                       torch.float8_e4m3fn)}
    for name, (bm, up_n, down_n, down_c, warps) in rules.items():
        up = GemmConfig(bm, up_n, 128, group_m=8, num_warps=warps, num_stages=4 if bm == 64 else 3,
                        tma_weights=True)
        down = GemmConfig(bm, down_n, down_c, group_m=8, num_warps=warps, num_stages=4,
                          tma_weights=True)
        configs[name] = MoEConfig(up, down, LayoutKind.SORTED)
    return configs


def main():
    ceilings = measure_ceilings(torch.device("cuda"))
    print(f"B = {ceilings.bandwidth / 1e12:.2f} TB/s, "
          f"F8 = {ceilings.fp8_matmul_flops / 1e12:.0f} TFLOP/s", flush=True)
    for shape, tokens in ((QWEN3_30B_A3B, (1024, 4096, 16384)), (MIXTRAL_8X7B, (256, 1024, 4096)),
                          (DEEPSEEK_V3, (1024, 4096)), (E64_K4, (1024, 4096))):
        torch.cuda.empty_cache()
        fp8 = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda")).to_format(
            WeightFormat.fp8_block())
        torch.cuda.empty_cache()
        for T in tokens:
            inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1)
            args = (inputs.hidden_states[0], fp8, inputs.topk_ids[0], inputs.topk_weights[0])
            scales = (fp8.w13_scale.numel() + fp8.w2_scale.numel()) * 4 // shape.num_experts
            floor = floor_seconds(layer_bytes(shape, inputs.topk_ids[0], 1, scales),
                                  layer_flops(shape, T), ceilings, fp8=True)
            results = []
            for name, config in candidates(shape, T).items():
                try:
                    us = do_bench(lambda: run_experts(*args, config=config), warmup=25, rep=150,
                                  return_mode="median") * 1e3
                    results.append((us, name, config.describe()))
                except Exception as error:  # out of resources etc.: report and go on
                    print(f"  {shape.name} T={T} {name}: {type(error).__name__}: "
                          f"{str(error)[:100]}", flush=True)
            for us, name, described in sorted(results):
                print(f"{shape.name} T={T} {us:9.1f} us  floor {floor * 1e6:8.1f} us  "
                      f"{floor * 1e6 / us:.2f}  "
                      f"{name:32s} {described}", flush=True)
        del fp8


if __name__ == "__main__":
    main()
