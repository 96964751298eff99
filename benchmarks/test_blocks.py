"""Decode latency of 4 MiniMax-M3-like MoE blocks through CUDA graphs, shared || routed overlap
on vs off (H=6144, 128 experts of I=3072, top-4, shared I=3072, clamped swiglu, routed scaling
2.0; the transformers config defaults): routed experts on "alt", shared experts on the main stream.
"""
import pytest
import torch
from measure import event_median_seconds

from moe_triton.graphs import DecodeGraphRunner, ForwardMode, GraphConfig, StaticInput
from moe_triton.models import default_dtype
from moe_triton.models.layers import Batch
from moe_triton.tools.bench import random_init_

BATCHES = (1, 4, 16, 64)
LAYERS = 4


@pytest.fixture(scope="module")
def minimax_m3_like():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    from moe_triton.models.minimax_m3 import MiniMaxM3MoeBlock

    config = MiniMaxM3VLTextConfig()
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        blocks = [random_init_(MiniMaxM3MoeBlock(config)) for _ in range(LAYERS)]
    yield config, blocks
    del blocks
    torch.cuda.empty_cache()


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

        runner = DecodeGraphRunner(step,
                                   {"hidden_states": StaticInput((config.hidden_size,),
                                                                 torch.bfloat16)},
                                   GraphConfig(batch_sizes=(batch,), show_progress=False))
        runner.capture()
        x = torch.randn(batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        times[overlap] = event_median_seconds(lambda: runner({"hidden_states": x}))
    record(f"decode step, {LAYERS} MiniMax-M3-like MoE blocks, shared || routed "
           "(bf16, graphs)", dict(
        batch=batch, serial_us=f"{times[False] * 1e6:.0f}", overlap_us=f"{times[True] * 1e6:.0f}",
        speedup=f"{times[False] / times[True]:.3f}x"))
    benchmark.extra_info.update(batch=batch, serial_s=times[False], overlap_s=times[True],
                                dtype="bfloat16", backend="triton", model="minimax-m3-like")
    benchmark.pedantic(lambda: (runner({"hidden_states": x}), torch.cuda.synchronize()), rounds=20,
                       warmup_rounds=2)
