"""Decode-size projections (issue 30): moe_triton.gemv against torch's F.linear (cuBLAS) at a
Qwen3-30B-A3B decode step's shapes, bf16, T = 1-16 rows, each against the weight's byte floor
(N x C x 2 bytes over the copy bandwidth B measured in the same run). do_bench medians with L2
flushed before each call (a step's 48 layers stream their weights from HBM); the two timed in
turn, three rounds. Then the full-size model's decode step (48 layers, random bf16 weights,
context 1k, through graphs) with models/' projections on gemv and on F.linear, captured in turn.

    python -m pytest benchmarks/test_gemv.py -m gpu --benchmark-only --bench-table gemv.md
"""
import statistics

import pytest
import torch
import torch.nn.functional as F
from measure import commit, event_median_seconds, qwen3_30b_a3b_config, random_weights_
from triton.testing import do_bench

from moe_triton.gemv import gemv
from moe_triton.models import default_dtype

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


@pytest.mark.gpu
def test_the_model_step_with_and_without_gemv(benchmark, record, monkeypatch):
    from moe_triton.models import layers
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config()))
    applies = layers.gemv_applies
    for batch in (1, 8):
        inputs = {"token_ids": torch.randint(0, model.config.vocab_size, (batch,), device="cuda"),
                  "positions": torch.full((batch,), 1023, device="cuda"),
                  "slots": torch.arange(batch, device="cuda")}
        times = {"gemv": [], "F.linear": []}
        for _ in range(2):
            for name in times:
                monkeypatch.setattr(layers, "gemv_applies",
                                    applies if name == "gemv" else lambda x, w: False)
                model.cache = model.graphs = None
                model.setup(max_batch=batch, max_seq=1032, batch_sizes=(batch,))
                times[name].append(event_median_seconds(lambda: model.graphs.run(inputs)))
        ours, cublas = (statistics.median(times[k]) for k in ("gemv", "F.linear"))
        record("Qwen3-30B-A3B-shaped decode step (48 layers, bf16, graphs, context 1k): "
               "projections on gemv vs F.linear", dict(
                   commit=commit(), batch=batch, f_linear_us=f"{cublas * 1e6:.0f}",
                   gemv_us=f"{ours * 1e6:.0f}", ratio=f"{ours / cublas:.3f}"))
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
