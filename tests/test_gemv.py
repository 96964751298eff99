"""gemv.py: decode-size projections, against float32 torch; the split contraction's partials
summed by the last program, calls repeated (the counters return to zero) and, on the H200, at a
Qwen3-30B-A3B step's shapes and inside a CUDA graph."""
import pytest
import torch
from helpers import assert_close, relative_error, test_device

from moe_triton.gemv import GemvConfig, choose_gemv_config, gemv, gemv_torch


def operands(T, N, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).to(test_device(), dtype)
    w = (torch.randn(N, C, generator=g) / C**0.5).to(test_device(), dtype)
    return x, w


# N and C off the tiles (100 of 64-column blocks, 200 of 32-wide steps: a short last slice)
@pytest.mark.parametrize("slices", [1, 3], ids=lambda s: f"slices{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 5, 16])
def test_gemv_matches_the_reference(T, dtype, slices):
    x, w = operands(T, 100, 200, dtype, seed=T)
    config = GemvConfig(block_c=32, slices=slices)
    expected = gemv_torch(x, w)
    for _ in range(2):  # the second call finds the counters back at zero
        assert_close(gemv(x, w, config), expected, dtype)


def test_empty_batch_and_bad_input():
    x, w = operands(0, 64, 64, torch.float32)
    assert gemv(x, w).shape == (0, 64)
    x, w = operands(17, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="T <= 16"):
        gemv(x, w)


def test_the_split_fills_the_sms_and_keeps_four_steps_a_slice():
    assert choose_gemv_config(N=2048, C=4096, num_sms=132).slices == 8  # o_proj: 32 blocks
    assert choose_gemv_config(N=5120, C=2048, num_sms=132).slices == 4  # qkv: 80 blocks
    assert choose_gemv_config(N=151936, C=2048, num_sms=132).slices == 1  # the LM head


QWEN3_STEP = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
              "lm_head": (151936, 2048), "shared up": (1536, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("name", list(QWEN3_STEP))
def test_gemv_at_a_decode_steps_shapes_on_the_gpu(name, T):
    N, C = QWEN3_STEP[name]
    x, w = operands(T, N, C, torch.bfloat16, seed=T)
    expected = (x.float() @ w.float().T)
    assert relative_error(gemv(x, w), expected) < 1e-2
    assert torch.equal(gemv(x, w), gemv(x, w))  # the slices' order is fixed
    graph, out = torch.cuda.CUDAGraph(), None
    gemv(x, w)
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, gemv(x, w))
