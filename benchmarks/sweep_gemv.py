"""Sweep moe_triton.gemv's tiles at a decode step's projections, behind a norm, in graphs.

Not a test: a script for the GPU machine that informs `moe_triton.gemv.choose_gemv_config`.
    python benchmarks/sweep_gemv.py > sweep-gemv.txt
Each (shape, rows, config) is a captured chain of 48 [add_rms_norm -> projection] links, each
link its own weight (HBM-resident, as a step's layers), weights prefetched under the norm (PDL);
µs a link, beside F.linear's link and the norm-only link, and the weight's floor at B.
"""
import itertools

import torch
import torch.nn.functional as F
import triton
from test_gemv import chain_inputs, link_seconds

from moe_triton.gemv import GemvConfig, choose_gemv_config, gemv

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)}
BANDWIDTH = 4.2e12  # bytes/s, the copy bandwidth measured beside (benchmarks/conftest.py)


def configs(T: int, N: int, C: int):
    if T > 1:  # the tensor-core tile
        for block_n, slices in itertools.product((32, 64), (2, 4, 8)):
            yield GemvConfig(block_n=block_n, block_c=256, slices=slices, tensor_cores=True)
        return
    for block_n, block_c, warps in itertools.product((16, 32, 64), (128, 256), (4, 8)):
        steps = triton.cdiv(C, block_c)
        for slices in sorted({steps // 2, steps // 4, steps // 8} - {0}):
            yield GemvConfig(block_n=block_n, block_c=block_c, slices=slices, num_warps=warps)


def main():
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (name, (N, C)), T in itertools.product(SHAPES.items(), (1, 8)):
        weights, x, residual, norm_weight = chain_inputs(T, N, C)
        args = (x, residual, norm_weight, weights)
        norm = link_seconds(None, *args)
        cublas = link_seconds(lambda h, w: F.linear(h, w), *args)
        print(f"# {name} {N}x{C} T={T}: floor {N * C * 2 / BANDWIDTH * 1e6:.1f} us, norm link "
              f"{norm * 1e6:.1f}, F.linear link {cublas * 1e6:.1f}; "
              f"chosen {choose_gemv_config(T, N, C, num_sms)}", flush=True)
        results = []
        for config in configs(T, N, C):
            try:
                t = link_seconds(lambda h, w, c=config: gemv(h, w, config=c, prefetch_weight=True),
                                 *args)
            except Exception as error:  # a config that does not compile: say so, go on
                print(f"  {config}: {type(error).__name__}", flush=True)
                continue
            results.append((t, config))
        for t, config in sorted(results, key=lambda r: r[0])[:8]:
            print(f"  {t * 1e6:6.1f} us ({t / cublas:.3f} of F.linear)  {config}", flush=True)


if __name__ == "__main__":
    main()
