"""The transformers drop-in in eager mode (issue 29): what `experts_implementation="moe_triton"`
does to a full-size Qwen3-30B-A3B-shaped transformers model's decode, bf16 and FP8.

The model: transformers' own Qwen3MoeForCausalLM, 48 layers, random bf16 weights built on the GPU,
sdpa attention, a StaticCache holding a 1024-token prompt; then one token per sequence per step,
each step timed between CUDA events (host launch time included): the median of 20 steps after 3
warm-up steps, over three rounds that take the implementations in turn. Beside each step time: the
host time of the step's model call (perf_counter; the call queues kernels without waiting, so this
is what the host spends) and the experts modules' share of it (forward hooks): the share
moe_triton can cut.

FP8: the same model with every layer's experts replaced by transformers' FP8Experts (block-128
scales quantized from the bf16 weights by transformers' own Fp8Quantize), dispatched through
FP8ExpertsInterface to moe_triton. transformers' own FP8 experts paths (grouped_mm, batched_mm,
deepgemm) run on kernels it downloads from the Hub, which this GPU machine cannot reach, so the
FP8 drop-in is compared with the bf16 implementations of the same model: what transformers runs
offline.

    python -m pytest benchmarks/test_dropin.py -m gpu --benchmark-only --bench-table dropin.md
"""
import statistics
import time

import pytest
import torch
from measure import commit, qwen3_30b_a3b_config, random_weights_, transformers_fp8_experts

from moe_triton.models import (
    default_dtype,  # importing moe_triton registers "moe_triton" in transformers
)

CONTEXT = 1024
WARMUP, STEPS = 3, 20
DEVICE = "cuda"
WAYS = (("bf16", "grouped_mm"), ("bf16", "batched_mm"), ("bf16", "moe_triton"),
        ("fp8 block-128", "moe_triton"))
ROUNDS = 3
TABLE = ("transformers eager decode, Qwen3-30B-A3B-shaped (48 layers), 1024-token context, "
         "StaticCache")


class HostClock:
    """perf_counter seconds spent inside `modules`' forwards (hooks), summed until reset."""

    def __init__(self, modules):
        self.seconds, self._started = 0.0, 0.0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, *args):
        self._started = time.perf_counter()

    def _leave(self, *args):
        self.seconds += time.perf_counter() - self._started


def use_experts(model, experts: list, implementation: str) -> None:
    for layer, module in zip(model.model.layers, experts, strict=True):
        layer.mlp.experts = module
    model.set_experts_implementation(implementation)


def decode_round(model, batch: int, experts: list, implementation: str, bf16_experts: list,
                 clock: HostClock) -> list[tuple[float, float, float]]:
    """(GPU-event step time, host time of the model call, the experts' host share) of STEPS
    decode steps after WARMUP, on `experts` under `implementation`; the CONTEXT-token prompt is
    prefilled into a fresh StaticCache by bf16 grouped_mm (batched_mm's prefill would gather a
    weight copy per (token, expert) pair: 384 GiB at batch 8)."""
    from transformers import StaticCache

    config = model.config
    use_experts(model, bf16_experts, "grouped_mm")
    cache = StaticCache(config=config, max_cache_len=CONTEXT + WARMUP + STEPS + 1)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (batch, CONTEXT), device=DEVICE,
                           generator=generator)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.no_grad():
        token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        use_experts(model, experts, implementation)
        for step in range(WARMUP + STEPS):
            position = torch.full((batch, 1), CONTEXT + step, device=DEVICE)
            torch.cuda.synchronize()
            clock.seconds = 0.0
            start.record()
            started = time.perf_counter()
            logits = model(token, past_key_values=cache, position_ids=position,
                           use_cache=True).logits
            host = time.perf_counter() - started
            end.record()
            end.synchronize()
            token = logits[:, -1:].argmax(-1)
            if step >= WARMUP:
                times.append((start.elapsed_time(end) * 1e-3, host, clock.seconds))
    use_experts(model, bf16_experts, "grouped_mm")
    return times


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config(num_layers=48)))
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8], ids=lambda b: f"batch{b}")
def test_eager_decode_bf16_and_fp8(benchmark, model, batch, record):
    bf16_experts = [layer.mlp.experts for layer in model.model.layers]
    fp8_experts = [transformers_fp8_experts(experts, model.config) for experts in bf16_experts]
    clock = HostClock(bf16_experts + fp8_experts)
    experts_of = {"bf16": bf16_experts, "fp8 block-128": fp8_experts}
    times = {way: [] for way in WAYS}
    for _ in range(ROUNDS):  # interleaved: this host's speed drifts by tens of percent
        for fmt, implementation in WAYS:
            times[(fmt, implementation)] += decode_round(model, batch, experts_of[fmt],
                                                         implementation, bf16_experts, clock)
    medians = {way: [statistics.median(column) for column in zip(*rows, strict=True)]
               for way, rows in times.items()}
    grouped = medians[("bf16", "grouped_mm")][0]
    best_bf16 = min(step for (fmt, name), (step, *_) in medians.items()
                    if fmt == "bf16" and name != "moe_triton")
    layers = len(bf16_experts)
    for (fmt, implementation), (step, host, experts_host) in medians.items():
        record(TABLE, dict(
            commit=commit(), batch=batch, experts=fmt, experts_implementation=implementation,
            ms_per_token=f"{step * 1e3:.2f}", vs_grouped_mm_bf16=f"{step / grouped:.2f}",
            vs_best_transformers_bf16=f"{step / best_bf16:.2f}",
            host_ms_per_step=f"{host * 1e3:.2f}",
            experts_host_ms_per_step=f"{experts_host * 1e3:.2f}",
            experts_host_us_per_layer=f"{experts_host * 1e6 / layers:.0f}"))
    benchmark.extra_info.update(batch=batch, medians={f"{k[0]} {k[1]}": v
                                                      for k, v in medians.items()})
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
