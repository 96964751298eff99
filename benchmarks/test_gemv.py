"""Decode projections (issue 30): moe_triton.gemv, its weights streamed behind the kernel in front
(PDL), against torch's F.linear (cuBLAS), bf16, where a decode step runs them: behind a norm.

First each Qwen3-30B-A3B projection as a chain of 48 [add_rms_norm -> projection] links, each
link its own weight (so the weights stream from HBM, as a step's 48 layers do), captured in one
CUDA graph and replayed; per link, against the norm-only chain's link and the weight's byte floor
(N x C x 2 bytes over the copy bandwidth B measured in the same run). The three projection kinds
in turn, three rounds, medians. The same at one row with the weights in FP8 (block and channel
scales, as checkpoints store them) against F.linear over the dequantized bf16 weights. Then the
full-size model's decode step (48 layers, random bf16 weights, context 1k, through graphs) with
the projections on gemv and on F.linear, in turn.

    python -m pytest benchmarks/test_gemv.py -m gpu --benchmark-only --bench-table gemv.md
"""
import statistics

import pytest
import torch
import torch.nn.functional as F
from measure import commit, event_median_seconds, qwen3_30b_a3b_config, random_weights_

from moe_triton import linear
from moe_triton.gemv import gemv
from moe_triton.graphs import capture_graph
from moe_triton.models import default_dtype
from moe_triton.models.rms_norm import add_rms_norm
from moe_triton.weights import WeightFormat, quantize_weight

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
          "shared up": (1536, 2048)}
LINKS = 48
PROJECTIONS = {
    "norm only": None,
    "F.linear": lambda x, w: F.linear(x, w),
    "gemv": lambda x, w: gemv(x, w),
    "gemv, prefetched": lambda x, w: gemv(x, w, prefetch_weight=True),
}


def link_seconds(project, x, residual, norm_weight, weights) -> float:
    """Seconds a link of one captured chain of [add_rms_norm -> project(h, weight)] links."""
    def link(i):
        h, _ = add_rms_norm(x, residual, norm_weight, 1e-6)
        return h if project is None else project(h, weights[i])

    graph = capture_graph(link, len(weights))
    return event_median_seconds(graph.replay) / len(weights)


def chain_inputs(T: int, N: int, C: int):
    """A chain's LINKS bf16 weights (N, C), one a link, and its x (T, C), residual, norm weight."""
    weights = [torch.randn(N, C, device="cuda", dtype=torch.bfloat16) / C**0.5
               for _ in range(LINKS)]
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    return weights, x, torch.randn_like(x), torch.rand(C, device="cuda").bfloat16()


def link_medians(variants: dict, x, residual, norm_weight, rounds: int = 3) -> dict[str, float]:
    """Median seconds a link of each variant (name -> (project, the links' weights)), the
    variants timed in turn, `rounds` times."""
    times = {kind: [] for kind in variants}
    for _ in range(rounds):
        for kind, (project, weights) in variants.items():
            times[kind].append(link_seconds(project, x, residual, norm_weight, weights))
    return {kind: statistics.median(t) for kind, t in times.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gemv_behind_a_norm_in_graphs(benchmark, T, ceilings, record):
    for name, (N, C) in SHAPES.items():
        weights, *link_inputs = chain_inputs(T, N, C)
        link = link_medians({kind: (project, weights) for kind, project in PROJECTIONS.items()},
                            *link_inputs)
        floor = N * C * 2 / ceilings.bandwidth
        row = dict(commit=commit(), shape=f"{name} {N}x{C}", T=T, floor_us=f"{floor * 1e6:.1f}",
                   norm_us=f"{link['norm only'] * 1e6:.1f}")
        for kind in list(PROJECTIONS)[1:]:
            projection = link[kind] - link["norm only"]
            row[f"{kind} link_us"] = f"{link[kind] * 1e6:.1f}"
            row[f"{kind} of floor"] = f"{floor / projection:.2f}" if projection > 0 else "-"
        record(f"decode projections, bf16, behind add_rms_norm: {LINKS} links a graph, "
               "per link (µs); 'of floor': floor / (link - norm-only link)", row)
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result


FP8_FORMATS = {"block 128": WeightFormat.fp8_block(), "channel": WeightFormat.fp8_channel()}


@pytest.mark.gpu
def test_fp8_gemv_behind_a_norm_in_graphs(benchmark, ceilings, record):
    """One row, FP8 weights as checkpoints store them, against F.linear over the bf16 weights
    an FP8 checkpoint's projections are dequantized to at load today (issue 30); floors at the
    stored bytes (1 a weight, the scales aside)."""
    for name, (N, C) in SHAPES.items():
        weights, *link_inputs = chain_inputs(1, N, C)
        variants = {"norm only": (None, weights), "F.linear bf16": (F.linear, weights)}
        for kind, fmt in FP8_FORMATS.items():
            stored = [quantize_weight(w, fmt) for w in weights]
            variants[f"gemv fp8 {kind}"] = (
                lambda h, w, fmt=fmt: gemv(h, w[0], weight_scale=w[1], weight_format=fmt,
                                           prefetch_weight=True), stored)
        link = link_medians(variants, *link_inputs)
        floor = N * C / ceilings.bandwidth
        row = dict(commit=commit(), shape=f"{name} {N}x{C}", fp8_floor_us=f"{floor * 1e6:.1f}",
                   norm_us=f"{link['norm only'] * 1e6:.1f}")
        for kind in list(variants)[1:]:
            row[f"{kind} link_us"] = f"{link[kind] * 1e6:.1f}"
        record(f"decode projections at one row, FP8 weights, behind add_rms_norm: {LINKS} links "
               "a graph, per link (µs)", row)
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result


@pytest.mark.gpu
def test_the_model_step_with_and_without_gemv(benchmark, record, monkeypatch):
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config()))
    applies = linear.gemv_applies
    for batch in (8, 64):
        inputs = {"token_ids": torch.randint(0, model.config.vocab_size, (batch,), device="cuda"),
                  "positions": torch.full((batch,), 1023, device="cuda"),
                  "slots": torch.arange(batch, device="cuda")}
        times = {"gemv": [], "F.linear": []}
        for _ in range(2):
            for name in times:
                rule = applies if name == "gemv" else lambda *args: False
                monkeypatch.setattr(linear, "gemv_applies", rule)  # dense's choice
                model.cache = model.graphs = None
                model.setup(max_batch=batch, max_seq=1032, batch_sizes=(batch,))
                times[name].append(event_median_seconds(lambda: model.graphs.run(inputs)))
        ours, cublas = (statistics.median(times[k]) for k in ("gemv", "F.linear"))
        record("Qwen3-30B-A3B-shaped decode step (48 layers, bf16, graphs, context 1k): "
               "projections on gemv vs F.linear", dict(
                   commit=commit(), batch=batch, f_linear_us=f"{cublas * 1e6:.0f}",
                   gemv_us=f"{ours * 1e6:.0f}", ratio=f"{ours / cublas:.3f}"))
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
