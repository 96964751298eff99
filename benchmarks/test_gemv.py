"""Decode-size projections (issue 30): moe_triton.gemv against torch's F.linear (cuBLAS) at a
Qwen3-30B-A3B decode step's shapes, bf16, T = 1-16 rows, each against the weight's byte floor
(N x C x 2 bytes over the copy bandwidth B measured in the same run). do_bench medians with L2
flushed before each call (a step's 48 layers stream their weights from HBM); the two timed in
turn, three rounds. do_bench's event timing has a floor of ~8 us a call here (the 0.5 MB router
takes 8.6): below ~15 us compare in graph replays, as the model step does.

    python -m pytest benchmarks/test_gemv.py -m gpu --benchmark-only --bench-table gemv.md
"""
import statistics

import pytest
import torch
import torch.nn.functional as F
from measure import commit
from triton.testing import do_bench

from moe_triton.gemv import gemv

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
          "lm_head": (151936, 2048), "shared up": (1536, 2048)}
ROWS = (1, 2, 4, 8, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_against_cublas(benchmark, name, ceilings, record):
    N, C = SHAPES[name]
    w = torch.randn(N, C, device="cuda", dtype=torch.bfloat16) / C**0.5
    floor = N * C * 2 / ceilings.bandwidth
    for T in ROWS:
        x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
        times = {"cublas": [], "gemv": []}
        for _ in range(3):
            times["cublas"].append(do_bench(lambda: F.linear(x, w), return_mode="median") * 1e-3)
            times["gemv"].append(do_bench(lambda: gemv(x, w), return_mode="median") * 1e-3)
        cublas, ours = (statistics.median(times[k]) for k in ("cublas", "gemv"))
        record("decode projections, bf16: gemv vs F.linear (L2 flushed)", dict(
            commit=commit(), shape=f"{name} {N}x{C}", T=T, floor_us=f"{floor * 1e6:.1f}",
            cublas_us=f"{cublas * 1e6:.1f}", gemv_us=f"{ours * 1e6:.1f}",
            cublas_frac=f"{floor / cublas:.2f}", gemv_frac=f"{floor / ours:.2f}",
            ratio=f"{ours / cublas:.3f}"))
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result

