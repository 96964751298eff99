"""Decode-step latency through CUDA graphs, overlap on vs off, at real layer widths and 4 layers.

- Command-A-Plus-like parallel blocks (Cohere2-MoE defaults: H=8192, 64 heads of 128, 8 KV heads,
  8 experts of I=22528, top-2, one shared expert; 3 sliding + 1 global layer): attention || MLP
  on "alt_mlp", shared || routed on "alt".
- MiniMax-M3-like MoE blocks (H=6144, 128 experts of I=3072, top-4, shared I=3072, clamped
  swiglu, routed scaling 2.0): routed on "alt" || shared on the main stream.
A small vocabulary keeps the LM head out of the way: the question is the layers.
"""
import statistics

import pytest
import torch

from moe_triton.graphs import DecodeGraphRunner, ForwardMode, GraphConfig, StaticInput
from moe_triton.models.layers import Batch

BATCHES = (1, 4, 16, 64)
LAYERS = 4


def init_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def median_seconds(fn, iterations=30):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


@pytest.fixture(scope="module")
def command_a_plus_like():
    from transformers import Cohere2MoeConfig

    from moe_triton.models.cohere2_moe import Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(vocab_size=1024, num_hidden_layers=LAYERS, num_shared_experts=1,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=4096)
    with torch.device("cuda"):
        model = init_(Cohere2MoeForCausalLM(config)).to(torch.bfloat16).eval()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
def test_parallel_block_overlap(benchmark, command_a_plus_like, batch, record):
    model = command_a_plus_like
    times = {}
    for overlap in (False, True):
        model.use_overlap = overlap
        model.setup(max_batch=batch, max_seq=512, batch_sizes=(batch,))
        inputs = {"token_ids": torch.randint(0, 1024, (batch,), device="cuda"),
                  "positions": torch.full((batch,), 100, device="cuda"), "slots": torch.arange(batch, device="cuda")}
        times[overlap] = median_seconds(lambda: model.graphs(inputs))
    record(f"decode step, {LAYERS} Command-A-Plus-like parallel blocks (bf16, graphs)", dict(
        batch=batch, serial_us=f"{times[False] * 1e6:.0f}", overlap_us=f"{times[True] * 1e6:.0f}",
        speedup=f"{times[False] / times[True]:.3f}x"))
    benchmark.extra_info.update(batch=batch, serial_s=times[False], overlap_s=times[True], dtype="bfloat16",
                                backend="triton", model="command-a-plus-like")
    benchmark.pedantic(lambda: (model.graphs(inputs), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)


@pytest.fixture(scope="module")
def minimax_m3_like():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    from moe_triton.models.minimax_m3 import MiniMaxM3MoeBlock

    config = MiniMaxM3VLTextConfig()
    with torch.device("cuda"):
        blocks = [init_(MiniMaxM3MoeBlock(config)).to(torch.bfloat16) for _ in range(LAYERS)]
    return config, blocks


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES)
def test_shared_routed_overlap(benchmark, minimax_m3_like, batch, record):
    config, blocks = minimax_m3_like
    times = {}
    for overlap in (False, True):
        def step(inputs, overlap=overlap):
            x = inputs["hidden_states"]
            batch_info = Batch(ForwardMode.DECODE, torch.empty(0), torch.empty(0), overlap=overlap)
            for block in blocks:
                x = x + block(x, batch_info)
            return x

        runner = DecodeGraphRunner(step, {"hidden_states": StaticInput((config.hidden_size,), torch.bfloat16)},
                                   GraphConfig(batch_sizes=(batch,), show_progress=False))
        runner.capture()
        x = torch.randn(batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        times[overlap] = median_seconds(lambda: runner({"hidden_states": x}))
    record(f"decode step, {LAYERS} MiniMax-M3-like MoE blocks, shared || routed (bf16, graphs)", dict(
        batch=batch, serial_us=f"{times[False] * 1e6:.0f}", overlap_us=f"{times[True] * 1e6:.0f}",
        speedup=f"{times[False] / times[True]:.3f}x"))
    benchmark.extra_info.update(batch=batch, serial_s=times[False], overlap_s=times[True], dtype="bfloat16",
                                backend="triton", model="minimax-m3-like")
    benchmark.pedantic(lambda: (runner({"hidden_states": x}), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
