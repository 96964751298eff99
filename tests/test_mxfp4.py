"""MXFP4 experts (W4A16) and expert biases through run_experts, against the float32 torch reference
on the dequantized weights (weights.py's `dequantize_mxfp4`, which shares no code with the kernel's
in-register expansion).

An MXFP4 weight is a power of two times an e2m1 value: exact in float32, and in fp16 / bf16 at the
scales here, so the kernels and the reference compute with the same weights and the tolerances are
the activation dtype's alone (helpers.TOLERANCE): float32 sums in another order, fp16's intermediate
rounded once between the GEMMs; on the GPU, bf16's, as a relative RMS (helpers.relative_error).
"""
import functools

import pytest
import torch
from helpers import assert_close, gpt_oss_checkpoint, poison_, random_ids, relative_error

from moe_triton import (
    Activation,
    ActivationKind,
    ExpertWeights,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    WeightFormat,
    fused_experts_torch,
    run_experts,
)

MXFP4 = WeightFormat.mxfp4()
CLAMPED = Activation(ActivationKind.CLAMPED_SWIGLU)  # gpt-oss's: limit 7, alpha 1.702
CPU_CONFIG = {layout: MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 64), layout)
              for layout in LayoutKind}


def experts(E, H, I, fmt=MXFP4, activation=Activation(), biased=True, seed=0, device="cpu"):
    """Random experts in `fmt` (biases in bf16, as gpt-oss ships them), outputs O(1)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if activation.gated else I
    native = ExpertWeights(torch.randn(E, rows, H, generator=g) / H**0.5,
                           torch.randn(E, H, I, generator=g) / I**0.5, activation.gated)
    if biased:
        native = ExpertWeights(native.w13, native.w2, native.gated,
                               w13_bias=torch.randn(E, rows, generator=g).bfloat16(),
                               w2_bias=torch.randn(E, H, generator=g).bfloat16())
    weights = native if fmt is None else native.to_format(fmt)
    tensors = {name: getattr(weights, name).to(device) if getattr(weights, name) is not None
               else None for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")}
    return ExpertWeights(gated=weights.gated, format=weights.format, **tensors)


def reference(x, weights: ExpertWeights, ids, topk_weights, activation=Activation()):
    return fused_experts_torch(x, *weights.dequantized(), ids, topk_weights, activation=activation,
                               w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)


# H = 96 and I = 160: C tails of one and two 32-groups past the 64-wide steps; K > E with filtered
# ids (expert-parallel shards); T = 0.
@pytest.mark.parametrize("T,E,K,layout", [
    (0, 4, 2, LayoutKind.SORTED), (1, 4, 2, LayoutKind.PER_PAIR), (3, 4, 2, LayoutKind.PER_PAIR),
    (17, 4, 2, LayoutKind.SORTED), (9, 2, 4, LayoutKind.SORTED)], ids=str)
@pytest.mark.parametrize("activation,dtype,biased", [
    (Activation(), torch.float32, False), (CLAMPED, torch.float32, True),
    (CLAMPED, torch.float16, True), (Activation(ActivationKind.RELU2), torch.float16, True),
], ids=lambda v: v.kind.name if isinstance(v, Activation) else str(v).split(".")[-1])
def test_mxfp4_experts(T, E, K, layout, activation, dtype, biased, poisoned_empty):
    weights = experts(E, 96, 160, activation=activation, biased=biased, seed=T + E)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 96, generator=g).to(dtype)
    ids = random_ids(T, K, E, seed=T, filtered=0.3) if K <= E else torch.randint(
        -1, E + 1, (T, K), generator=g)
    topk_weights = torch.rand(T, K, generator=g)
    out = run_experts(x, weights, ids.int(), topk_weights, activation=activation,
                      config=CPU_CONFIG[layout])
    assert out.shape == (T, 96) and out.dtype == dtype
    assert_close(out, reference(x, weights, ids, topk_weights, activation), dtype, scale=2)


@pytest.mark.parametrize("fmt", [None, WeightFormat.fp8_block(32, 32), WeightFormat.fp8_channel()],
                         ids=["native", "fp8-block", "fp8-channel"])
def test_biases_in_every_format(fmt, poisoned_empty):
    """Biases join the sums before the activation and before the routing weight, whatever the
    weights' format; split-C adds the second GEMM's once (its first slice)."""
    dtype = torch.float32 if fmt is None else torch.float16  # FP8 activations: fp16 on the CPU
    weights = experts(4, 64, 96, fmt=fmt, seed=1)
    x = torch.randn(11, 64).to(dtype)
    ids, topk_weights = random_ids(11, 2, 4, seed=2).int(), torch.rand(11, 2)
    expected = reference(x, weights, ids, topk_weights)
    unbiased = reference(x, ExpertWeights(weights.w13, weights.w2, format=weights.format,
                                          w13_scale=weights.w13_scale, w2_scale=weights.w2_scale),
                         ids, topk_weights)
    assert (expected - unbiased).abs().max() > 0.1 * expected.abs().max()  # the biases matter
    for splits in (1, 3):
        config = MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32, split_c=splits),
                           LayoutKind.SORTED)
        out = run_experts(x, weights, ids, topk_weights, config=config)
        # FP8: four e4m3 roundings of 2^-4 at most (tests/test_fp8.py), as a relative RMS
        if fmt is None:
            assert_close(out, expected, dtype)
        else:
            assert relative_error(out, expected) < 0.1


def test_mxfp4_nan_scale_reaches_the_outputs_it_touches(poisoned_empty):
    """A scale byte of 255 is NaN (OCP MX): in w2 it spoils one output column of the rows routed
    to that expert, as in the dequantized reference; every other element stays finite."""
    weights = experts(4, 64, 64, biased=False, seed=3)
    w2_scale = weights.w2_scale.clone()
    w2_scale[1, 5, 0] = 255  # expert 1, output column 5, its first 32 of I
    weights = ExpertWeights(weights.w13, weights.w2, format=MXFP4, w13_scale=weights.w13_scale,
                            w2_scale=w2_scale)
    x = torch.randn(9, 64)
    ids, topk_weights = random_ids(9, 2, 4, seed=4).int(), torch.rand(9, 2)
    out = run_experts(x, weights, ids, topk_weights, config=CPU_CONFIG[LayoutKind.SORTED])
    expected = reference(x, weights, ids, topk_weights)
    nan = expected.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan)
    assert nan.sum() == (ids == 1).any(dim=1).sum()  # column 5 of the rows that use expert 1
    assert_close(out[~nan], expected[~nan], torch.float32)


def test_mxfp4_steps_hold_whole_scale_groups(no_launch):
    weights = experts(2, 64, 64, biased=False)
    x, ids = torch.randn(3, 64), random_ids(3, 1, 2, seed=0).int()
    config = MoEConfig(GemmConfig(16, 32, 16), GemmConfig(16, 32, 32), LayoutKind.SORTED)
    with pytest.raises(ValueError, match="block_c=16: an MXFP4 C step holds whole 32-value"):
        run_experts(x, weights, ids, torch.rand(3, 1), config=config)


@pytest.mark.parametrize("fmt", [None, MXFP4], ids=["native", "mxfp4"])
def test_bias_gradients_match_autograd_on_the_reference(fmt):
    """x and both biases take gradients (MXFP4 weights none: quantized, as FP8); the backward is
    the reference's, checked against torch autograd through fused_experts_torch."""
    weights = experts(4, 64, 64, fmt=fmt, activation=CLAMPED, seed=5)
    b13, b2 = (b.float().requires_grad_() for b in (weights.w13_bias, weights.w2_bias))
    leaves = dict(w13_bias=b13, w2_bias=b2)
    if fmt is None:
        leaves |= dict(w13=weights.w13.clone().requires_grad_(),
                       w2=weights.w2.clone().requires_grad_())
    trainable = ExpertWeights(**({"w13": weights.w13, "w2": weights.w2} | leaves), format=fmt,
                              w13_scale=weights.w13_scale, w2_scale=weights.w2_scale)
    x = torch.randn(7, 64, requires_grad=True)
    ids, topk_weights = random_ids(7, 2, 4, seed=6).int(), torch.rand(7, 2, requires_grad=True)
    grad_out = torch.randn(7, 64)
    inputs = [x, topk_weights, *leaves.values()]
    ours = torch.autograd.grad(run_experts(x, trainable, ids, topk_weights, activation=CLAMPED),
                               inputs, grad_out)
    w13, w2 = (leaves["w13"], leaves["w2"]) if fmt is None else weights.dequantized()
    theirs = torch.autograd.grad(
        fused_experts_torch(x, w13, w2, ids, topk_weights, activation=CLAMPED, w13_bias=b13,
                            w2_bias=b2), inputs, grad_out)
    for mine, expected in zip(ours, theirs, strict=True):
        assert_close(mine, expected, torch.float32)


def test_bad_biases_name_the_tensor():
    weights = experts(2, 64, 64, biased=False)
    with pytest.raises(ValueError, match=r"w13_bias must be a .* of shape \(2, 128\)"):
        ExpertWeights(weights.w13, weights.w2, format=MXFP4, w13_scale=weights.w13_scale,
                      w2_scale=weights.w2_scale, w13_bias=torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"w2_bias must be a float tensor"):
        ExpertWeights(weights.w13, weights.w2, format=MXFP4, w13_scale=weights.w13_scale,
                      w2_scale=weights.w2_scale, w2_bias=torch.zeros(2, 64, dtype=torch.int32))


def test_interleaved_checkpoint_biases_follow_their_rows():
    """gpt-oss stores gate/up rows and their biases interleaved: from_checkpoint reorders both."""
    weights = experts(2, 64, 64, seed=7)
    gate, up = weights.w13.chunk(2, dim=1)
    interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)  # [g0, u0, g1, u1, ...]
    scales = torch.stack(weights.w13_scale.chunk(2, dim=1), dim=2).flatten(1, 2)
    bias = torch.stack(weights.w13_bias.chunk(2, dim=1), dim=2).flatten(1, 2)
    loaded = ExpertWeights.from_checkpoint(interleaved, weights.w2, MXFP4, scales,
                                           weights.w2_scale, interleaved=True, w13_bias=bias,
                                           w2_bias=weights.w2_bias)
    for name in ("w13", "w13_scale", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(loaded, name), getattr(weights, name)), name


# ---- the GPU: bf16 at real sizes, graphs ---------------------------------------------------------

GPT_OSS_20B = dict(E=32, K=4, H=2880, I=2880)  # gpt-oss-20b's expert layer
QWEN3 = dict(E=128, K=8, H=2048, I=768)


@functools.lru_cache(maxsize=2)
def gpu_experts(E, K, H, I, biased):
    weights = experts(E, H, I, activation=CLAMPED if biased else Activation(), biased=biased,
                      device="cuda")
    return weights, ExpertWeights(*(w.bfloat16() for w in weights.dequantized()), format=None,
                                  w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 512, 4096])
@pytest.mark.parametrize("shape,biased", [(GPT_OSS_20B, True), (QWEN3, False)],
                         ids=["gpt-oss-20b", "qwen3"])
def test_mxfp4_experts_on_the_gpu(shape, biased, T):
    """Against the float32 reference on the dequantized weights and against our bf16 layer on
    them (the same weights exactly: only the kernels' rounding differs)."""
    weights, dequantized = gpu_experts(**shape, biased=biased)
    activation = CLAMPED if biased else Activation()
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, shape["H"], generator=g, device="cuda").bfloat16()
    logits = torch.randn(T, shape["E"], generator=g, device="cuda")
    topk_weights, ids = logits.softmax(-1).topk(shape["K"])
    out = run_experts(x, weights, ids.int(), topk_weights, activation=activation)
    bf16 = run_experts(x, dequantized, ids.int(), topk_weights, activation=activation)
    expected = reference(x, weights, ids, topk_weights, activation)
    assert relative_error(out, expected) < 1e-2 and relative_error(bf16, expected) < 1e-2
    assert relative_error(out, bf16) < 1e-2


@pytest.mark.gpu
def test_the_bf16_pair_expansion_gives_the_portable_one_s_bits():
    """The inline-PTX expansion (two bf16 values a register) against the portable one, compiled,
    on every byte (both nibbles, both signs, the subnormal codes) under scales 2^-127 (0), small,
    1 (127), large, saturating (241, 254) and NaN (255): the same bf16 bits, NaN for NaN."""
    import triton
    import triton.language as tl

    from moe_triton._expert_gemm_kernels import (
        MXFP4_BF16_PAIRS,
        MXFP4_PORTABLE,
        _mxfp4_expanded,
    )

    @triton.jit
    def expand_both(packed_ptr, e8m0_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        n, p = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_C // 2)
        g = tl.arange(0, BLOCK_C // 32)
        packed = tl.load(packed_ptr + n[:, None] * (BLOCK_C // 2) + p[None, :])
        e8m0 = tl.load(e8m0_ptr + n[:, None] * (BLOCK_C // 32) + g[None, :])
        tile = n[:, None] * (BLOCK_C // 2) + p[None, :]
        size = BLOCK_N * BLOCK_C // 2
        even, odd = _mxfp4_expanded(packed, e8m0, tl.bfloat16, MXFP4_PORTABLE, BLOCK_N, BLOCK_C)
        tl.store(out_ptr + tile, even.to(tl.int16, bitcast=True))
        tl.store(out_ptr + size + tile, odd.to(tl.int16, bitcast=True))
        even, odd = _mxfp4_expanded(packed, e8m0, tl.bfloat16, MXFP4_BF16_PAIRS, BLOCK_N,
                                    BLOCK_C)
        tl.store(out_ptr + 2 * size + tile, even.to(tl.int16, bitcast=True))
        tl.store(out_ptr + 3 * size + tile, odd.to(tl.int16, bitcast=True))

    N, C = 64, 64
    packed = torch.arange(N * C // 2, device="cuda").remainder(256).to(torch.uint8)
    packed = packed.view(N, C // 2)  # every byte, 8 times
    exponents = torch.tensor([0, 1, 100, 127, 200, 240, 241, 254, 255], device="cuda")
    e8m0 = exponents[torch.arange(N * C // 32, device="cuda") % len(exponents)]
    e8m0 = e8m0.to(torch.uint8).view(N, C // 32)
    out = torch.empty(4, N, C // 2, dtype=torch.int16, device="cuda")
    expand_both[(1,)](packed, e8m0, out, BLOCK_N=N, BLOCK_C=C)
    portable, paired = out[:2].view(torch.bfloat16), out[2:].view(torch.bfloat16)
    nan = portable.isnan()
    assert nan.any() and torch.equal(paired.isnan(), nan)
    assert torch.equal(out[:2][~nan], out[2:][~nan])


@pytest.mark.gpu
def test_mxfp4_graph_replay_equals_eager():
    from moe_triton.graphs import capture_graph

    weights, _ = gpu_experts(**GPT_OSS_20B, biased=True)
    xs = [torch.randn(4, 2880, device="cuda").bfloat16() for _ in range(2)]
    ids = [torch.randint(0, 32, (4, 4), device="cuda").int() for _ in range(2)]
    topk_weights = [torch.rand(4, 4, device="cuda") for _ in range(2)]
    outputs = {}

    def step(i):
        outputs[i] = run_experts(xs[i], weights, ids[i], topk_weights[i], activation=CLAMPED)

    eager = [run_experts(xs[i], weights, ids[i], topk_weights[i], activation=CLAMPED)
             for i in range(2)]
    graph = capture_graph(step, 2)
    for out in outputs.values():
        poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        assert torch.equal(outputs[i], eager[i])


# ---- gpt-oss's published MXFP4 layout (helpers.gpt_oss_checkpoint), read by both ----------------

def test_gpt_oss_mxfp4_layout_reads_as_transformers_dequantizes_it(tmp_path):
    """transformers (offline: Mxfp4Config(dequantize=True)) and ExpertWeights.from_checkpoint
    read the same published tensors into the same float32 weights and biases, bit for bit."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    state = gpt_oss_checkpoint(tmp_path, mxfp4=True)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        ours = ExpertWeights.from_checkpoint(
            state[prefix + "gate_up_proj_blocks"].flatten(-2), state[prefix + "down_proj_blocks"]
            .flatten(-2), MXFP4, state[prefix + "gate_up_proj_scales"],
            state[prefix + "down_proj_scales"], interleaved=True,
            w13_bias=state[prefix + "gate_up_proj_bias"], w2_bias=state[prefix + "down_proj_bias"])
        theirs = model.model.layers[layer].mlp.experts  # GptOssExperts: [E, H, 2I] interleaved
        w13, w2 = ours.dequantized()
        gate, up = theirs.gate_up_proj.transpose(1, 2)[:, 0::2], theirs.gate_up_proj.transpose(
            1, 2)[:, 1::2]
        assert torch.equal(w13, torch.cat([gate, up], dim=1))
        assert torch.equal(w2, theirs.down_proj.transpose(1, 2))
        bias = theirs.gate_up_proj_bias
        assert torch.equal(ours.w13_bias.float(), torch.cat([bias[:, 0::2], bias[:, 1::2]], 1))
        assert torch.equal(ours.w2_bias.float(), theirs.down_proj_bias)
