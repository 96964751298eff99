"""Decode-step latency through CUDA graphs, overlap on vs off, at real layer widths and 4 layers.

- Command-A-Plus-like parallel blocks (Cohere2-MoE defaults: H=8192, 64 heads of 128, 8 KV heads,
  8 experts of I=22528, top-2, one shared expert; 3 sliding + 1 global layer): attention || MLP
  on "alt_mlp", shared || routed on "alt".
(MiniMax-M3-like shared || routed blocks: benchmarks/test_blocks.py.)
A small vocabulary keeps the LM head out of the way: the question is the layers.
"""
import pytest
import torch
from measure import event_median_seconds

from moe_triton.models import default_dtype
from moe_triton.tools.bench import random_init_

BATCHES = (1, 4, 16, 64)
LAYERS = 4


@pytest.fixture(autouse=True)
def overlap_at_every_batch(monkeypatch):
    """What overlap does at each batch, past the buckets CausalLM overlaps by default too (the
    measurement its rule comes from)."""
    import moe_triton.models.causal_lm as causal_lm

    monkeypatch.setattr(causal_lm, "OVERLAP_MAX_BATCH", 1 << 30)


@pytest.fixture(scope="module")
def command_a_plus_like():
    from transformers import Cohere2MoeConfig

    from moe_triton.models.cohere2_moe import Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(vocab_size=1024, num_hidden_layers=LAYERS, num_shared_experts=1,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              sliding_window=4096)
    # ~41 GB of bf16 weights: never build them in fp32
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_init_(Cohere2MoeForCausalLM(config)).eval()
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
def test_parallel_block_overlap(benchmark, command_a_plus_like, batch, record):
    model = command_a_plus_like
    times = {}
    for overlap in (False, True):
        model.use_overlap = overlap
        model.setup(max_batch=batch, max_seq=512, batch_sizes=(batch,))
        inputs = {"token_ids": torch.randint(0, 1024, (batch,), device="cuda"),
                  "positions": torch.full((batch,), 100, device="cuda"),
                  "slots": torch.arange(batch, device="cuda")}
        times[overlap] = event_median_seconds(lambda: model.graphs.run(inputs))
    record(f"decode step, {LAYERS} Command-A-Plus-like parallel blocks (bf16, graphs)", dict(
        batch=batch, serial_us=f"{times[False] * 1e6:.0f}", overlap_us=f"{times[True] * 1e6:.0f}",
        speedup=f"{times[False] / times[True]:.3f}x"))
    benchmark.extra_info.update(batch=batch, serial_s=times[False], overlap_s=times[True],
                                dtype="bfloat16", backend="triton", model="command-a-plus-like")
    benchmark.pedantic(lambda: (model.graphs.run(inputs), torch.cuda.synchronize()), rounds=20,
                       warmup_rounds=2)
