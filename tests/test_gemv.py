"""gemv.py: decode-size projections, against float32 torch; the split contraction's partials
summed by the last program, calls repeated (the counters return to zero), compiled for sm_90
without a GPU and, on the H200, at a Qwen3-30B-A3B step's shapes, behind a norm (PDL) and inside a
CUDA graph."""
import re

import pytest
import torch
from helpers import assert_close, compile_for_sm90, relative_error, test_device

from moe_triton.gemv import (
    PROGRAMS_PER_SM,
    ROWS_WEIGHT_BYTES,
    GemvConfig,
    choose_gemv_config,
    gemv,
    gemv_applies,
    gemv_torch,
)
from moe_triton.weights import WeightFormat, quantize_weight


def operands(T, N, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).to(test_device(), dtype)
    w = (torch.randn(N, C, generator=g) / C**0.5).to(test_device(), dtype)
    return x, w


# N and C off the tiles (100 off 32- and 64-column blocks, 200 off 32-wide steps: a short last
# slice)
@pytest.mark.parametrize("slices", [1, 3], ids=lambda s: f"slices{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
# one row by FMAs or through the tensor cores' tile (16, 32 or 64 rows); more rows: the tile
@pytest.mark.parametrize("T,fma", [(1, True), (1, False), (5, False), (16, False), (33, False),
                                   (64, False)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_gemv_matches_the_reference(T, fma, dtype, slices, bias):
    x, w = operands(T, 100, 200, dtype, seed=T)
    b = torch.randn(100, generator=torch.Generator().manual_seed(5)).to(x.device, dtype) if bias \
        else None
    config = GemvConfig(block_c=32, slices=slices, tensor_cores=not fma)
    expected = gemv_torch(x, w, b)
    for _ in range(2):  # the second call finds the counters back at zero
        assert_close(gemv(x, w, b, config=config), expected, dtype)


FP8_FORMATS = {"tensor": WeightFormat.fp8_tensor(), "channel": WeightFormat.fp8_channel(),
               "block128": WeightFormat.fp8_block(), "block16x32": WeightFormat.fp8_block(16, 32)}


@pytest.mark.parametrize("slices", [1, 3], ids=lambda s: f"slices{s}")
@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("T,fma", [(1, True), (5, False)])
def test_fp8_weights_match_the_dequantized_reference(T, fma, fmt, slices):
    """An FP8 w read with its checkpoint-layout scale: as F.linear over the dequantized weight
    (the same quantized values both sides, so fp16's tolerance), N and C off every tile."""
    x, w = operands(T, 100, 200, torch.float16, seed=T)
    q, scale = quantize_weight(w.float(), FP8_FORMATS[fmt])
    config = GemvConfig(block_c=32 if fmt != "block16x32" else 16, slices=slices,
                        tensor_cores=not fma)
    expected = gemv_torch(x, q, weight_scale=scale, weight_format=FP8_FORMATS[fmt])
    out = gemv(x, q, config=config, weight_scale=scale, weight_format=FP8_FORMATS[fmt])
    assert_close(out, expected, torch.float16)


def test_fp8_weights_need_a_float32_scale_in_their_format():
    x, w = operands(1, 64, 64, torch.float16)
    q, scale = quantize_weight(w.float(), WeightFormat.fp8_block(32, 32))
    with pytest.raises(ValueError, match="needs weight_scale and a dynamic FP8 weight_format"):
        gemv(x, q)
    with pytest.raises(ValueError, match=r"float32 of shape \(2, 2\)"):
        gemv(x, q, weight_scale=scale.half(), weight_format=WeightFormat.fp8_block(32, 32))
    with pytest.raises(ValueError, match=r"float32 of shape \(64, 1\) or \(64,\)"):
        gemv(x, q, weight_scale=scale, weight_format=WeightFormat.fp8_channel())
    with pytest.raises(ValueError, match="weight_scale is for"):
        gemv(x, w, weight_scale=scale)
    with pytest.raises(ValueError, match="read row by row"):
        gemv(x, q, weight_scale=scale.t().contiguous().t(),
             weight_format=WeightFormat.fp8_block(32, 32))


def test_empty_batch_and_bad_input():
    x, w = operands(0, 64, 64, torch.float32)
    assert gemv(x, w).shape == (0, 64)
    x, w = operands(65, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="T <= 64"):
        gemv(x, w)
    with pytest.raises(ValueError, match=r"bias must be a float \(64,\)"):
        gemv(x[:1], w, torch.zeros(63))
    with pytest.raises(ValueError, match="on one device"):  # before any launch: no crash
        gemv(x[:1], w.to("meta"))


QWEN3_STEP = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048),
              "lm_head": (151936, 2048), "shared up": (1536, 2048)}


def test_slices_fill_the_sms():
    one_row = {name: choose_gemv_config(1, N, C, num_sms=132).slices
               for name, (N, C) in QWEN3_STEP.items()}  # powers of two
    assert one_row == {"qkv": 4, "o": 8, "router": 8, "lm_head": 1, "shared up": 8}
    # rows: within two programs an SM, the steps spread evenly, at least two a slice
    rows = {name: choose_gemv_config(64, N, C, num_sms=132).slices
            for name, (N, C) in QWEN3_STEP.items()}
    assert rows == {"qkv": 2, "o": 5, "router": 8, "lm_head": 1, "shared up": 6}


def test_the_projections_compile_for_sm90_with_their_programs_resident():
    """Every Qwen3 decode projection, one row and 16, bf16 and qkv's in FP8 (block and channel
    scales), compiled for sm_90 without a GPU, weights prefetched (tests/sm90_compile.py); one
    row's programs fit PROGRAMS_PER_SM to an SM's 64K registers, as choose_gemv_config's grid
    assumes (every program prefetching at launch)."""
    cases = [{"gemv": [T, N, C]} for T in (1, 16) for N, C in QWEN3_STEP.values()]
    cases += [{"gemv": [T, 5120, 2048], **fmt} for T in (1, 16)
              for fmt in ({"format": "block", "block": [128, 128]}, {"format": "channel"})]
    run = compile_for_sm90(cases, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == len(cases), run.stdout
    threads = 32 * GemvConfig().num_warps * PROGRAMS_PER_SM  # an SM's one-row programs
    for line in lines[:len(QWEN3_STEP)] + lines[-4:-2]:  # one row
        for registers in re.findall(r"_gemv_kernel:(\d+)", line):
            assert -(-int(registers) // 8) * 8 * threads <= 65536, line  # ptxas allots by 8


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 64])
@pytest.mark.parametrize("name", list(QWEN3_STEP))
def test_gemv_at_a_decode_steps_shapes_on_the_gpu(name, T):
    N, C = QWEN3_STEP[name]
    x, w = operands(T, N, C, torch.bfloat16, seed=T)
    expected = (x.float() @ w.float().T)
    assert relative_error(gemv(x, w), expected) < 1e-2
    assert torch.equal(gemv(x, w), gemv(x, w))  # the slices' order is fixed
    # models/ take it at one row below an LM head's width, at more the small weights only
    assert gemv_applies(x, w) == (name != "lm_head" and (T == 1 or N * C * 2 <= ROWS_WEIGHT_BYTES))
    graph, out = torch.cuda.CUDAGraph(), None
    gemv(x, w)
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, gemv(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["block128", "channel", "tensor"])
@pytest.mark.parametrize("T", [1, 16, 64])
def test_fp8_weights_at_a_decode_steps_shape_on_the_gpu(T, fmt):
    """bf16 rows, FP8 qkv weights: within bf16's rounding of the dequantized float32 product,
    prefetched or not, the same bits."""
    N, C = QWEN3_STEP["qkv"]
    x, w = operands(T, N, C, torch.bfloat16, seed=T)
    q, scale = quantize_weight(w.float(), FP8_FORMATS[fmt])
    stored = dict(weight_scale=scale, weight_format=FP8_FORMATS[fmt])
    expected = gemv_torch(x.float(), q, **stored)
    out = gemv(x, q, **stored)
    assert relative_error(out, expected) < 1e-2
    assert torch.equal(out, gemv(x, q, **stored, prefetch_weight=True))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64])
def test_prefetched_weights_behind_a_norm_equal_the_plain_launch(T):
    """PDL: the weight loads start under the norm, x is read after it; a graph of norm ->
    projection links, replayed, gives the plain launch's bits."""
    from moe_triton.models.rms_norm import add_rms_norm

    N, C = QWEN3_STEP["qkv"]
    x, _ = operands(T, N, C, torch.bfloat16, seed=T)
    weights = [operands(T, N, C, torch.bfloat16, seed=10 + i)[1] for i in range(4)]
    residual, norm_weight = torch.randn_like(x), torch.rand(C, device="cuda").bfloat16()

    def links(prefetch):
        outs = []
        for w in weights:
            h, _ = add_rms_norm(x, residual, norm_weight, 1e-6)
            outs.append(gemv(h, w, prefetch_weight=prefetch))
        return outs

    expected = links(False)
    for out, plain in zip(links(True), expected, strict=True):
        assert torch.equal(out, plain)
    links(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = links(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        for out, plain in zip(outs, links(False), strict=True):
            assert torch.equal(out, plain)



def test_a_split_plans_partials_outlive_a_full_cache(monkeypatch):
    """A graph captured through a split gemv writes its partials by address at every replay, so
    the cache keeps that plan when it is full: the partials are never freed."""
    import gc
    import weakref

    import moe_triton.gemv as gemv_module
    from moe_triton.launch import PlanCache

    monkeypatch.setattr(gemv_module, "_PLANS", PlanCache(size=1))
    x, w = operands(1, 100, 200, torch.float32)
    gemv(x, w, config=GemvConfig(block_c=32, slices=3))
    (plan,) = gemv_module._PLANS._plans.values()
    partials = weakref.ref(plan.partials)
    del plan
    for n in (64, 96, 128):  # other signatures, one slice (no partials), past the cache's size
        gemv(x, torch.randn(n, 200), config=GemvConfig(block_c=32))
    gc.collect()
    assert partials() is not None
    assert_close(gemv(x, w, config=GemvConfig(block_c=32, slices=3)), gemv_torch(x, w),
                 torch.float32)
