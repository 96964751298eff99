"""What `batch_invariant()` costs (issue 33), each ratio taken in one run with the two modes timed
in turn (interleaved rounds, medians):

- The layer on the grid's four shapes, bf16 and FP8 block-128, M from 1 to 4096: run_experts
  through CUDA-graph replays of four calls over rotated inputs (the grid benchmark's timing), one
  graph per mode, three alternations.
- The model step: a full-size Qwen3-30B-A3B-shaped model of moe_triton.models (48 layers, random
  bf16 weights drawn on the GPU) decoding one step through its graphs at context 1k, batch 1, 8
  and 64, with the graphs captured in each mode in turn.

    python -m pytest benchmarks/test_batch_invariance.py -m gpu --benchmark-only
        --bench-table batch-invariance.md
"""
import statistics

import pytest
import torch
from measure import (
    commit,
    event_median_seconds,
    interleaved_layer_seconds,
    qwen3_30b_a3b_config,
    random_weights_,
)

from moe_triton import ExpertWeights, WeightFormat, batch_invariant, run_experts
from moe_triton.models import default_dtype
from moe_triton.tools.bench import GRID_SHAPES, random_experts

LAYER_M = (1, 4, 16, 64, 256, 1024, 4096)
STEP_BATCHES, CONTEXT = (1, 8, 64), 1024
MODES = (False, True)


def in_mode(mode: bool):
    def call(x, weights, ids, topk_weights):
        with batch_invariant(mode):
            return run_experts(x, weights, ids, topk_weights)
    return call


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRID_SHAPES))
def test_the_layers_cost_on_the_grid(benchmark, name, record):
    shape = GRID_SHAPES[name]
    native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    for fmt, weights in (("bf16", native),
                         ("fp8-block128", native.to_format(WeightFormat.fp8_block(128, 128)))):
        with torch.no_grad():
            for M in LAYER_M:
                times = interleaved_layer_seconds(shape, weights, M,
                                                  {mode: in_mode(mode) for mode in MODES})
                default, invariant = times[False], times[True]
                record("run_experts, default vs batch_invariant(), graph replays", dict(
                    commit=commit(), shape=name, format=fmt, M=M,
                    default_us=f"{default * 1e6:.1f}", invariant_us=f"{invariant * 1e6:.1f}",
                    ratio=f"{invariant / default:.3f}"))
        del weights
    del native
    torch.cuda.empty_cache()
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result


@pytest.fixture(scope="module")
def model():
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        return random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config()))


def step_seconds(model, batch: int, mode: bool) -> float:
    """One decode step at position CONTEXT - 1 through graphs captured in `mode`."""
    model.cache = model.graphs = None
    torch.cuda.empty_cache()
    inputs = {"token_ids": torch.randint(0, model.config.vocab_size, (batch,), device="cuda"),
              "positions": torch.full((batch,), CONTEXT - 1, device="cuda"),
              "slots": torch.arange(batch, device="cuda")}
    with batch_invariant(mode):
        model.setup(max_batch=batch, max_seq=CONTEXT + 8, batch_sizes=(batch,))
        assert model.graphs_batch_invariant is mode
        return event_median_seconds(lambda: model.graphs.run(inputs))


@pytest.mark.gpu
def test_the_model_steps_cost(benchmark, model, record):
    for batch in STEP_BATCHES:
        times = {mode: [] for mode in MODES}
        for _ in range(2):
            for mode in MODES:
                times[mode].append(step_seconds(model, batch, mode))
        default, invariant = (statistics.median(times[mode]) for mode in MODES)
        record("Qwen3-30B-A3B-shaped decode step (48 layers, bf16, graphs, context 1k), default vs "
               "batch_invariant()", dict(commit=commit(), batch=batch,
                                         default_us=f"{default * 1e6:.0f}",
                                         invariant_us=f"{invariant * 1e6:.0f}",
                                         ratio=f"{invariant / default:.3f}"))
    model.cache = model.graphs = None
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
