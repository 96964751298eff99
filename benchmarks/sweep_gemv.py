"""Sweep moe_triton.gemv's tiles at a decode step's projections, behind a norm, in graphs.

Not a test: a script for the GPU machine that informs `moe_triton.gemv.choose_gemv_config`.
    python benchmarks/sweep_gemv.py > sweep-gemv.txt           # bf16, one row and 8
    python benchmarks/sweep_gemv.py --fp8 > sweep-gemv-fp8.txt  # FP8 weights, one row
Each (shape, rows, config) is a captured chain of 48 [add_rms_norm -> projection] links, each
link its own weight (HBM-resident, as a step's layers), weights prefetched under the norm (PDL);
µs a link, beside F.linear's link and the norm-only link, and the weight's floor at B.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from test_gemv import chain_inputs, link_seconds

from moe_triton.gemv import GemvConfig, choose_gemv_config, gemv
from moe_triton.weights import WeightFormat, quantize_weight

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
          "shared up": (1536, 2048)}
BANDWIDTH = 4.2e12  # bytes/s, the copy bandwidth measured beside (benchmarks/conftest.py)


def configs(T: int, N: int, C: int, block_cs=(128, 256)):
    if T > 1:  # the tensor-core tile: pipelined, slices filling 1-3 programs an SM
        for block_n, block_c, stages in ((64, 64, 4), (64, 128, 3), (128, 64, 4), (32, 128, 4)):
            steps = triton.cdiv(C, block_c)
            for per_sm in (1, 2, 3):
                wanted = max(1, min(steps // 2, triton.cdiv(per_sm * 132, triton.cdiv(N, block_n))))
                yield GemvConfig(block_n=block_n, block_c=block_c, num_stages=stages, num_warps=4,
                                 slices=triton.cdiv(steps, triton.cdiv(steps, wanted)),
                                 tensor_cores=True)
        return
    # more, smaller programs an SM (4 warps): more tiles in flight at once, if the steps' latency
    # bounds one row (num_stages 2-3 measured no faster: docs/sweep-gemv-stages-2026-12-03.txt)
    for block_n, block_c, warps in itertools.product((16, 32), block_cs, (4, 8)):
        steps = triton.cdiv(C, block_c)
        for slices in sorted({steps // 2, steps // 4, steps // 8, steps // 16} - {0}):
            yield GemvConfig(block_n=block_n, block_c=block_c, slices=slices, num_warps=warps)


FP8_FORMATS = {"block 128": WeightFormat.fp8_block(), "channel": WeightFormat.fp8_channel()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp8", action="store_true", help="FP8 weights (block and channel)")
    parser.add_argument("--rows", default="1,8", help="rows (T) to sweep, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="projections, comma-separated")
    args = parser.parse_args()
    fp8, rows = args.fp8, [int(r) for r in args.rows.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    formats = FP8_FORMATS if fp8 else {"bf16": None}
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    for (name, (N, C)), T in itertools.product(shapes.items(), rows):
        weights, x, residual, norm_weight = chain_inputs(T, N, C)
        chain = (x, residual, norm_weight, weights)
        norm = link_seconds(None, *chain)
        cublas = link_seconds(lambda h, w: F.linear(h, w), *chain)
        for kind, fmt in formats.items():
            stored = [quantize_weight(w, fmt) for w in weights] if fmt else [(w, None)
                                                                          for w in weights]
            scale_c = fmt.block[1] if fmt is not None and fmt.block else None
            element = 1 if fmt else 2
            print(f"# {name} {N}x{C} T={T} {kind}: floor {N * C * element / BANDWIDTH * 1e6:.1f}"
                  f" us, norm link {norm * 1e6:.1f}, F.linear bf16 link {cublas * 1e6:.1f}; "
                  f"chosen {choose_gemv_config(T, N, C, num_sms, scale_c)}", flush=True)
            results = []
            for config in configs(T, N, C, (128,) if scale_c else (128, 256)):
                def project(h, w, c=config, fmt=fmt):
                    return gemv(h, w[0], config=c, weight_scale=w[1], weight_format=fmt,
                                prefetch_weight=True)
                try:
                    t = link_seconds(project, x, residual, norm_weight, stored)
                except Exception as error:  # a config that does not compile: say so, go on
                    print(f"  {config}: {type(error).__name__}", flush=True)
                    continue
                results.append((t, config))
            if T > 1:  # the chosen tile launched plainly: what the prefetch under the norm buys
                chosen = choose_gemv_config(T, N, C, num_sms, scale_c)
                plain = link_seconds(lambda h, w: gemv(h, w[0], config=chosen, weight_scale=w[1],
                                                       weight_format=fmt), *chain[:3], stored)
                print(f"  chosen, launched plainly: {plain * 1e6:6.1f} us", flush=True)
            for t, config in sorted(results, key=lambda r: r[0])[:8]:
                print(f"  {t * 1e6:6.1f} us ({t / cublas:.3f} of F.linear)  {config}", flush=True)


if __name__ == "__main__":
    main()
