"""What routing capture costs (issue 33): `generate` on a full-size Qwen3-30B-A3B-shaped model of
moe_triton.models (48 layers, its real config, random bf16 weights drawn on the GPU) at batch 1 and
8, a 128-token prompt and 64 new tokens through the decode graphs, without a routing tape and with
one recording every token's experts (`return_routing=True`), the two set up and timed in turn over
two interleaved rounds of three timed calls (after one warm-up) each. Wall time per call; the tape's
per-step cost = the difference over the 64 steps (prefill included, so an upper bound).

    python -m pytest benchmarks/test_routing_tape.py -m gpu --benchmark-only
        --bench-table routing-tape.md
"""
import statistics
import time

import pytest
import torch
from measure import commit, qwen3_30b_a3b_config, random_weights_

from moe_triton.models import default_dtype

PROMPT, NEW_TOKENS, ROUNDS, CALLS = 128, 64, 2, 3
TABLE = ("generate with and without a routing tape, Qwen3-30B-A3B-shaped (48 layers, bf16), "
         f"{PROMPT}-token prompt, {NEW_TOKENS} new tokens")


@pytest.fixture(scope="module")
def model():
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("cuda"), default_dtype(torch.bfloat16):
        return random_weights_(Qwen3MoeForCausalLM(qwen3_30b_a3b_config()))


def timed_calls(model, prompt, tape: bool) -> list[float]:
    model.setup(prompt.shape[0], PROMPT + NEW_TOKENS, batch_sizes=(prompt.shape[0],),
                routing_tape=tape)
    seconds = []
    for call in range(CALLS + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = model.generate(prompt, NEW_TOKENS, eos_token_id=None, return_routing=tape)
        torch.cuda.synchronize()
        if call:  # the first call warms up
            seconds.append(time.perf_counter() - started)
    if tape:  # every position through the model recorded
        assert (out[1] >= 0).all() and out[1].shape[2] == PROMPT + NEW_TOKENS - 1
    return seconds


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8], ids=lambda b: f"batch{b}")
def test_generate_with_and_without_a_routing_tape(benchmark, model, batch, record):
    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda")
    times = {False: [], True: []}
    for _ in range(ROUNDS):
        for tape in times:
            times[tape] += timed_calls(model, prompt, tape)
    plain, taped = (statistics.median(times[tape]) for tape in (False, True))
    record(TABLE, dict(commit=commit(), batch=batch, without_ms=f"{plain * 1e3:.2f}",
                       with_tape_ms=f"{taped * 1e3:.2f}", ratio=f"{taped / plain:.3f}",
                       tape_us_per_step=f"{(taped - plain) / NEW_TOKENS * 1e6:.0f}",
                       spread_without_ms=f"{min(times[False]) * 1e3:.1f}-"
                                         f"{max(times[False]) * 1e3:.1f}",
                       spread_with_ms=f"{min(times[True]) * 1e3:.1f}-"
                                      f"{max(times[True]) * 1e3:.1f}"))
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result
