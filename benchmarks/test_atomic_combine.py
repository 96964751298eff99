"""The fused combine (issue 27): MoEConfig.atomic_combine, where the down GEMM's epilogue adds
each weighted row into a float32 (T, H) with atomics, against the default down GEMM + finalize,
on the grid's four shapes at prefill sizes, bf16 and FP8 block-128. The same tiles otherwise
(choose_config's); both timed in turn in one run (benchmarks/measure.interleaved_layer_seconds).

    python -m pytest benchmarks/test_atomic_combine.py -m gpu --benchmark-only
        --bench-table atomic-combine.md
"""
from dataclasses import replace

import pytest
import torch
from measure import commit, interleaved_layer_seconds

from moe_triton import ExpertWeights, WeightFormat, run_experts
from moe_triton.pipeline import default_config
from moe_triton.tools.bench import GRID_SHAPES, random_experts

PREFILL_M = (256, 1024, 4096, 16384)


def with_config(atomic: bool):
    def call(x, weights, ids, topk_weights):
        config = default_config(x.shape[0], ids.shape[1], weights, x.device)
        return run_experts(x, weights, ids, topk_weights,
                           config=replace(config, atomic_combine=atomic))
    return call


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRID_SHAPES))
def test_atomic_combine_against_finalize(benchmark, name, record):
    shape = GRID_SHAPES[name]
    native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    for fmt, weights in (("bf16", native),
                         ("fp8-block128", native.to_format(WeightFormat.fp8_block(128, 128)))):
        with torch.no_grad():
            for M in PREFILL_M:
                times = interleaved_layer_seconds(shape, weights, M, {
                    "finalize": with_config(False), "atomic": with_config(True)})
                record("run_experts, down GEMM + finalize vs the atomic combine, graph replays",
                       dict(commit=commit(), shape=name, format=fmt, M=M,
                            finalize_us=f"{times['finalize'] * 1e6:.1f}",
                            atomic_us=f"{times['atomic'] * 1e6:.1f}",
                            ratio=f"{times['atomic'] / times['finalize']:.3f}"))
        del weights
    del native
    torch.cuda.empty_cache()
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
