"""The model's decode step and prefill at full size (issue 16): a Qwen3-30B-A3B-shaped model built
through moe_triton.models as load_model builds it (48 layers, its real config, random bf16 weights
drawn on the GPU, ~61 GB), never written to a checkpoint.

- Decode: one step through the model's CUDA graphs at batch 1, 8, 32, 64 with every sequence at
  context 1k and 8k, against the step's byte floor (measure.decode_step_bytes: every weight the step
  reads once, the experts the batch hits, the K/V of the real context) over the copy bandwidth B
  measured in the same run; and the kernels one step launches (torch.profiler over a replay).
- Prefill: tokens per second for one sequence of 2k and 8k tokens (eager, as prefill runs).
- Where a batch-1 and a batch-64 step go: every kernel of one replay by name, its launches per
  layer and its GPU time, and the idle time between kernels (the step's wall time minus its
  kernel time).
- The decode attention taking the step's own token (one launch: norm, rotary, cache write,
  attention) against the two-launch form (rotate_into_cache, then the attention), captured in
  turn over two rounds at batch 1 and 8, context 1k (issue 30); the expert GEMMs finding their
  pairs in the routing (BY_EXPERT) against expand's sorted layout, at batch 8, 32 and 64.

Targets (issue 16): batch-1 step <= 1.5x its floor, batch 32 >= 0.80 of its floor, <= 12 kernels
per layer per decode step.

    python -m pytest benchmarks/test_model_step.py -m gpu --benchmark-only
        --bench-table model-step.md
"""
import statistics

import pytest
import torch
from measure import (
    decode_step_bytes,
    event_median_seconds,
    prefill_flops,
    qwen3_30b_a3b_config,
    random_weights_,
    record_where_time_goes,
)

from moe_triton import config as configs
from moe_triton import pipeline
from moe_triton.config import BY_EXPERT_MATCH
from moe_triton.launch import PlanCache
from moe_triton.models import decode_attention as attention
from moe_triton.models import default_dtype

BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 8192)
PREFILL = (2048, 8192)


@pytest.fixture(scope="module")
def model():
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        return random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config()))


def free(model) -> None:
    model.cache = model.graphs = None
    torch.cuda.empty_cache()


def decode_setup(model, batch: int, context: int) -> dict[str, torch.Tensor]:
    """A fresh cache and graph for `batch` sequences; the inputs of one decode step at position
    context - 1."""
    free(model)  # the previous cache first: at batch 64 and 8k context the cache alone is ~52 GB
    model.setup(max_batch=batch, max_seq=context + 8, batch_sizes=(batch,))
    return {"token_ids": torch.randint(0, model.config.vocab_size, (batch,), device="cuda"),
            "positions": torch.full((batch,), context - 1, device="cuda"),
            "slots": torch.arange(batch, device="cuda")}


def kernels_per_step(step) -> int:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("context", CONTEXTS, ids=lambda c: f"ctx{c}")
def test_decode_step(benchmark, model, context, ceilings, record):
    config, layers = model.config, model.config.num_hidden_layers
    for batch in BATCHES:
        inputs = decode_setup(model, batch, context)
        step_s = event_median_seconds(lambda: model.graphs.run(inputs))
        floor_s = decode_step_bytes(config, batch, context) / ceilings.bandwidth
        kernels = kernels_per_step(lambda: model.graphs.run(inputs))
        record("Qwen3-30B-A3B-shaped decode step, 48 layers, bf16, through graphs", dict(
            context=context, batch=batch, step_us=f"{step_s * 1e6:.0f}",
            floor_us=f"{floor_s * 1e6:.0f}",
            floor_frac=f"{floor_s / step_s:.2f}", tokens_per_s=f"{batch / step_s:.0f}",
            kernels_per_layer=f"{kernels / layers:.1f}"))
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result


@pytest.mark.gpu
def test_prefill(benchmark, model, ceilings, record):
    for tokens in PREFILL:
        free(model)
        model.setup(max_batch=1, max_seq=tokens, batch_sizes=(1,))
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
        with torch.no_grad():
            # as generate() prefills
            seconds = event_median_seconds(lambda: model.prefill_last(ids), iterations=5)
        floor_s = prefill_flops(model.config, tokens) / ceilings.matmul_flops
        record("Qwen3-30B-A3B-shaped prefill, one sequence, bf16 (eager), against its compute "
               "floor (FLOPs at F)", dict(
                   tokens=tokens, prefill_ms=f"{seconds * 1e3:.1f}",
                   floor_ms=f"{floor_s * 1e3:.1f}", compute_frac=f"{floor_s / seconds:.2f}",
                   tokens_per_s=f"{tokens / seconds:.0f}"))
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", (1, 64))  # issue 30: the profile at batch 1 and 64
def test_decode_step_profile(benchmark, model, batch, record):
    layers = model.config.num_hidden_layers
    inputs = decode_setup(model, batch, 1024)
    step_s = event_median_seconds(lambda: model.graphs.run(inputs))
    record_where_time_goes(record, f"Where a decode step goes: batch {batch}, context 1k, one "
                           f"replay ({step_s * 1e6:.0f} us a step)",
                           lambda: model.graphs.run(inputs), step_s, layers)
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.gpu
def test_decode_step_with_the_token_in_the_attention_or_not(benchmark, model, record,
                                                            monkeypatch):
    fuses = attention._fuses
    for batch in (1, 8):
        times = {"one launch": [], "two launches": []}
        for _ in range(2):
            for form in times:
                rule = fuses if form == "one launch" else lambda *args: False
                monkeypatch.setattr(attention, "_fuses", rule)  # decode_attention's choice
                inputs = decode_setup(model, batch, 1024)
                times[form].append(event_median_seconds(lambda: model.graphs.run(inputs)))
        one, two = (statistics.median(times[form]) for form in times)
        record("Qwen3-30B-A3B-shaped decode step (bf16, graphs, context 1k): the new token in "
               "the attention's launch or rotary's before it", dict(
                   batch=batch, one_launch_us=f"{one * 1e6:.0f}",
                   two_launches_us=f"{two * 1e6:.0f}", ratio=f"{one / two:.3f}"))
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result


@pytest.mark.gpu
def test_decode_step_by_expert_or_sorted(benchmark, model, record, monkeypatch):
    """The expert GEMMs finding their pairs in the routing (BY_EXPERT: no expand kernels), or
    expand's sorted layout (its kernels chained by PDL): the layer plans built anew for each arm,
    captured in turn over two rounds."""
    for batch in (8, 32, 64):
        times = {"by_expert": [], "sorted": []}
        for _ in range(2):
            for form in times:
                monkeypatch.setattr(configs, "BY_EXPERT_MATCH",
                                    BY_EXPERT_MATCH if form == "by_expert" else 0)
                monkeypatch.setattr(pipeline, "_PLANS", PlanCache())
                inputs = decode_setup(model, batch, 1024)
                times[form].append(event_median_seconds(lambda: model.graphs.run(inputs)))
        by_expert, sorted_ = (statistics.median(times[form]) for form in times)
        record("Qwen3-30B-A3B-shaped decode step (bf16, graphs, context 1k): the expert GEMMs "
               "finding their pairs (by_expert) or expand's sorted layout", dict(
                   batch=batch, by_expert_us=f"{by_expert * 1e6:.0f}",
                   sorted_us=f"{sorted_ * 1e6:.0f}", ratio=f"{by_expert / sorted_:.3f}"))
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
