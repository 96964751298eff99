"""FP8 experts through run_experts and FusedMoE (under the Triton interpreter on CPU, whose e4m3 dot
is exact and whose casts we do not use), against two independent float32 computations:

- the emulation: the same quantization steps done with torch ops (activations per token or group,
  the intermediate per row and up.block_n columns), then float32 math. Kernel and emulation differ
  only in float32 summation order, which can move an intermediate value across an e4m3 rounding
  boundary: one 2^-3 step of one element, reaching an output through w2 weights of ~1/sqrt(I) of
  the row, stays well under EMULATION_TOL of max|ref|; the rest is the fp16 output's rounding.
- the dequantized reference: float32 weights as the FP8 weights stand for, unquantized activations.
  FP8 rounds each of x, w13, h and w2 by at most 2^-4 relative (uniform: RMS 2^-4 / sqrt(3) =
  0.036); four independent roundings give a relative RMS error near 2 * 0.036 = 0.072, bounded by
  FP8_RMS_TOL.
"""
import functools

import pytest
import torch
from helpers import assert_close, compile_for_sm90, copy_experts_

from moe_triton import (
    ExpertWeights,
    Fp8Scaling,
    FusedMoE,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    Placement,
    RoutingSpec,
    WeightFormat,
    fused_experts_torch,
    route_torch,
    run_experts,
)
from moe_triton.activation import SILU_AND_MUL, Activation, ActivationKind, activation_torch
from moe_triton.pipeline import _check_fp8_config
from moe_triton.platform import Platform
from moe_triton.quantize import dequantize_fp8_torch, quantize_fp8_torch

EMULATION_TOL = 1e-2  # of max|emulation|: summation order (see above)
# On Hopper the tensor cores sum FP8 products in fewer bits than float32 within each 128-wide step
# (expert_gemm.py promotes to float32 between steps): the kernel's intermediate then lands on the
# other side of an e4m3 rounding boundary more often than summation order alone would make it, each
# such value moving its outputs by one e4m3 step times a w2 weight. Over millions of outputs the
# worst one moves further, the typical one does not: the max bound widens on the GPU, the RMS bound
# stays.
GPU_EMULATION_MAX_TOL, GPU_EMULATION_RMS_TOL = 3e-2, 1e-2
FP8_RMS_TOL = 0.1  # relative RMS error against the dequantized float32 reference (see above)
FORMATS = {"block128": WeightFormat.fp8_block(128, 128),
           "block32x32": WeightFormat.fp8_block(32, 32),
           "block16x16": WeightFormat.fp8_block(16, 16),  # narrower than a C step: scaled within it
           "channel": WeightFormat.fp8_channel(), "tensor": WeightFormat.fp8_tensor(),
           "tensor-static": WeightFormat.fp8_tensor(static_input=True)}
CPU_CONFIG = {layout: MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32), layout)
              for layout in LayoutKind}


def fp8_layer(fmt, T, E=6, K=2, H=72, I=61, activation=SILU_AND_MUL, seed=0, filtered=False,
              native_nan=None,
              device="cpu", dtype=torch.float16):
    """Random FP8 experts in `fmt` and a call's inputs; `native_nan`: an index of w13 set to NaN
    before quantization."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if activation.gated else I
    w13 = torch.randn(E, rows, H, generator=g) / H**0.5
    if native_nan is not None:
        w13[native_nan] = float("nan")
    native = ExpertWeights(w13.to(device), (torch.randn(E, H, I, generator=g) / I**0.5).to(device),
                           activation.gated)
    weights = native.to_format(WeightFormat.fp8_tensor() if fmt.static_input else fmt)
    if fmt.static_input:  # a calibrated scale: the largest |x| expected, over 448
        weights = ExpertWeights(weights.w13, weights.w2, weights.gated, fmt, weights.w13_scale,
                                weights.w2_scale,
                                torch.tensor([3.5 / 448], device=device))
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int() if T
           else torch.empty(0, K).int())
    if filtered and T:
        ids[0, 0], ids[-1, -1] = -1, E  # both sentinels: contribute nothing
    return x, weights, ids.to(device), torch.rand(T, K, generator=g).to(device)


def emulation(x, weights, ids, topk_weights, block_n, activation=SILU_AND_MUL):
    fmt = weights.format
    group = fmt.block[1] if fmt.block else None
    xd = dequantize_fp8_torch(*quantize_fp8_torch(x, group, weights.input_scale), group)  # [T, H]
    w13, w2 = weights.dequantized()
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        h = activation_torch(xd[tokens] @ w13[e].T, activation)  # [n, I]
        hd = dequantize_fp8_torch(*quantize_fp8_torch(h, block_n), block_n)
        out.index_add_(0, tokens, (hd @ w2[e].T) * topk_weights[tokens, slots, None])
    return out


def check(out, x, weights, ids, topk_weights, block_n, activation=SILU_AND_MUL):
    assert out.dtype == x.dtype and out.shape == x.shape and not out.isnan().any()
    if out.numel() == 0:
        return
    emulated = emulation(x, weights, ids, topk_weights, block_n, activation)
    assert (out.float() - emulated).abs().max() <= EMULATION_TOL * emulated.abs().max()
    reference = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights,
                                    activation=activation)
    # every pair filtered (T = 1 with both sentinels): exactly nothing comes out
    if not reference.any():
        assert not out.any()
        return
    rms = ((out.float() - reference).square().mean() / reference.square().mean()).sqrt()
    assert rms <= FP8_RMS_TOL, f"relative RMS error {rms:.3f}"


@pytest.mark.parametrize("T,layout",
                         [(0, LayoutKind.SORTED), (1, LayoutKind.PER_PAIR),
                          (3, LayoutKind.PER_PAIR), (17, LayoutKind.SORTED)], ids=str)
@pytest.mark.parametrize("name", list(FORMATS))
def test_fp8_experts(name, T, layout, poisoned_empty):
    x, weights, ids, topk_weights = fp8_layer(FORMATS[name], T, filtered=True, seed=T)
    out = run_experts(x, weights, ids, topk_weights, config=CPU_CONFIG[layout])
    check(out, x, weights, ids, topk_weights, block_n=32)


@pytest.mark.parametrize("activation", [Activation(ActivationKind.RELU2),
                                        Activation(ActivationKind.CLAMPED_SWIGLU,
                                                   swiglu_limit=0.5)],
                         ids=lambda a: a.kind.name)
def test_fp8_activations(activation, poisoned_empty):
    x, weights, ids, topk_weights = fp8_layer(FORMATS["block128"], 9, activation=activation, seed=4)
    out = run_experts(x, weights, ids, topk_weights, activation=activation,
                      config=CPU_CONFIG[LayoutKind.SORTED])
    check(out, x, weights, ids, topk_weights, 32, activation)


def test_fp8_one_expert_wide_intermediate_and_split_c(poisoned_empty):
    """E = 1, I = 961 (7688 / 8: partial blocks everywhere) and the second GEMM split in three."""
    x, weights, ids, topk_weights = fp8_layer(FORMATS["block128"], 5, E=1, K=1, H=40, I=961, seed=5)
    config = MoEConfig(GemmConfig(16, 64, 32), GemmConfig(16, 32, 32, split_c=3))
    out = run_experts(x, weights, ids, topk_weights, config=config)
    check(out, x, weights, ids, topk_weights, block_n=64)


def test_fp8_bad_input_raises_before_launch(no_launch):
    x, weights, ids, topk_weights = fp8_layer(FORMATS["channel"], 4)
    with pytest.raises(ValueError, match="FP8 experts take bfloat16 or float16 activations"):
        run_experts(x.float(), weights, ids, topk_weights)
    narrow = MoEConfig(GemmConfig(16, 32, 16), GemmConfig(16, 32, 32))
    _check_fp8_config(narrow, torch.device("cpu"))  # the interpreter takes 16-wide steps
    with pytest.raises(ValueError,
                       match=r"config.up.block_c=16: FP8 GEMMs on a GPU step at least 32 columns"):
        _check_fp8_config(narrow, torch.device("cuda"))  # an 8-bit tl.dot does not compile there


def test_fp8_steps_wider_than_the_scale_groups(poisoned_empty):
    """64-wide steps over 32-wide weight blocks and activation groups (the up GEMM) and over the up
    GEMM's 32-column output groups (the down GEMM): each group is scaled within the step."""
    x, weights, ids, topk_weights = fp8_layer(FORMATS["block32x32"], 9, seed=6)
    out = run_experts(x, weights, ids, topk_weights,
                      config=MoEConfig(GemmConfig(16, 32, 64), GemmConfig(16, 32, 64)))
    check(out, x, weights, ids, topk_weights, block_n=32)


# ---- NaN: the README's contract, FP8 as every other format ---------------------------------------

# Each source in the formats whose kernel paths differ for it: activations quantized per row,
# group or static scale; weights on the e4m3 dot (scales per step or per sum) or dequantized
# within the step (16 x 16 blocks); scales per block, row or tensor.
NAN_CASES = ([("x", name) for name in FORMATS]
             + [(source, name) for source in ("w13", "w2")
                for name in ("block128", "block16x16", "channel")]
             + [(source, name) for source in ("w13_scale", "w2_scale")
                for name in ("block32x32", "block16x16", "channel", "tensor")]
             + [("unquantized w13", name) for name in ("block128", "channel", "tensor")]
             + [("input_scale", "tensor-static")])


def nan_layer(name, source, T=5, device="cpu", dtype=torch.float16, **sizes):
    """fp8_layer with one NaN in `source`: a hidden state; an e4m3 weight (0x7f / 0xff) of w13's up
    half or of w2; a scale (per tensor: the gate's, or w2's whole); a w13 weight before quantization
    (its block, row or tensor then quantizes to NaN); the static input scale."""
    fmt, e = FORMATS[name], 1
    native_nan = (e, 4, 9) if source == "unquantized w13" else None
    x, weights, ids, topk_weights = fp8_layer(fmt, T, filtered=True, seed=7, native_nan=native_nan,
                                              device=device, dtype=dtype, **sizes)
    I = weights.intermediate_size
    ids[1, 0] = e  # expert e has tokens (and, at random, not all of them)
    ids[0] = -1  # a token routed nowhere stays 0
    ids[0, -1] = weights.num_experts
    if source == "x":
        x[-1, 5] = float("nan")  # the last token: one pair filtered, one routed
    elif source == "w13":
        weights.w13.view(torch.uint8)[e, I + 2, 7] = 0x7F
    elif source == "w2":
        weights.w2.view(torch.uint8)[e, 5, 3] = 0xFF
    elif source in ("w13_scale", "w2_scale"):
        scale = getattr(weights, source)
        if fmt.fp8 is Fp8Scaling.TENSOR:  # one scale per expert and projection, stored per row
            scale[e, :I if source == "w13_scale" else None] = float("nan")
        else:
            scale[e].view(-1)[0] = float("nan")  # the first block (or row) of w13's gate, of w2
    elif source == "input_scale":
        weights.input_scale.fill_(float("nan"))
    return x, weights, ids, topk_weights


def check_nan(out, x, weights, ids, topk_weights, source):
    """NaN exactly where the float32 reference on the dequantized weights has it (an input scale
    NaN: every row with a routed pair, as quantizing with it gives); the rest within FP8's error."""
    reference = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights)
    expected = reference.isnan()
    if source == "input_scale":
        routed = ((ids >= 0) & (ids < weights.num_experts)).any(1)
        expected = routed[:, None].expand_as(reference)
    assert expected.any() and not expected.all()
    assert torch.equal(out.isnan(), expected)
    finite, ours = reference[~expected], out[~expected].float()
    if not finite.any():  # only tokens routed nowhere are left: exactly nothing came out
        assert not ours.any()
        return
    rms = ((ours - finite).square().mean() / finite.square().mean()).sqrt()
    assert rms <= FP8_RMS_TOL, f"relative RMS error {rms:.3f}"


@pytest.mark.parametrize("source,name", NAN_CASES, ids=lambda v: v.replace(" ", "-"))
def test_fp8_nan_rows_match_the_dequantized_reference(source, name, poisoned_empty):
    """Issue 25 item 2: NaN in a hidden state, an e4m3 weight, a scale or a weight before
    quantization came out finite (tl.max / tl.maximum drop NaN, the e4m3 cast and the interpreter's
    dot turn it finite). A NaN weight element of w13 makes its expert's rows NaN through the
    activation and w2; one of w2 only its output column; a NaN block scale its whole block."""
    x, weights, ids, topk_weights = nan_layer(name, source)
    layout = LayoutKind.PER_PAIR if source == "input_scale" else LayoutKind.SORTED
    out = run_experts(x, weights, ids, topk_weights, config=CPU_CONFIG[layout])
    check_nan(out, x, weights, ids, topk_weights, source)


# ---- compiled for the H200, on the CPU -----------------------------------------------------------

DEMO_SHAPE = dict(E=8, K=2, H=64, I=48)  # moe-triton demo's model
QWEN3_SHAPE = dict(E=4, E_real=128, K=8, H=2048, I=768)  # choose_config sees 128 experts
SM90_CASES = {
    "demo-16x16": [dict(DEMO_SHAPE, T=T, format="block", block=[16, 16]) for T in (1, 2, 16)],
    "qwen3": ([dict(QWEN3_SHAPE, T=T, format="block", block=block)
               for block in ([16, 16], [128, 128]) for T in (1, 64, 4096)]
              + [dict(QWEN3_SHAPE, T=T, format=name)
                 for name in ("channel", "tensor") for T in (1, 4096)]),
}


@pytest.mark.parametrize("cases", list(SM90_CASES))
def test_fp8_kernels_compile_for_sm90(cases):
    """Issue 25 item 11: the demo's FP8 kernels compiled only under the interpreter; on the H200 an
    8-bit tl.dot with K = 16 raised a CompilationError. Every kernel of these calls, with
    choose_config's H200 tiles, compiled for sm_90 by Triton and ptxas without a GPU
    (tests/sm90_compile.py), each within an H200's shared memory."""
    run = compile_for_sm90(SM90_CASES[cases], timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("new kernels compiled") == len(SM90_CASES[cases])


# ---- FusedMoE and the resolver ---------------------------------------------------------------

def fp8_module(backend="auto", fmt=FORMATS["block128"], platform=None, dtype=torch.float16):
    return FusedMoE(6, 2, 72, 61, routing=RoutingSpec(2, renormalize=True), weight_format=fmt,
                    placement=Placement(backend, platform=platform), dtype=dtype)


def load_random_fp8(layer, seed=0):
    x, weights, _, _ = fp8_layer(layer.weight_format, 1, seed=seed)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randn(layer.gate_weight.shape,
                                            generator=torch.Generator().manual_seed(seed)))
    copy_experts_(layer, weights)
    layer.prepare_weights()
    return layer


def test_fp8_layer_defaults_to_the_torch_reference_on_cpu_and_runs_triton_on_request():
    auto, triton = load_random_fp8(fp8_module()), load_random_fp8(fp8_module("triton"))
    assert (auto.backend == "torch"
            and "float32 torch reference, dequantized" in auto.resolution.reason)
    assert triton.backend == "triton" and triton.gate_up_proj.dtype == torch.float8_e4m3fn
    x = torch.randn(5, 72, generator=torch.Generator().manual_seed(1)).half()
    with torch.no_grad():
        ours, reference = triton(x).float(), auto(x).float()
    rms = ((ours - reference).square().mean() / reference.square().mean()).sqrt()
    assert rms <= FP8_RMS_TOL


def test_fp8_layer_in_float32_runs_on_the_dequantizing_torch_reference():
    """A float32 model of an FP8 checkpoint on CPU: the torch reference takes float32 activations
    (it dequantizes; no FP8 GEMM), and computes exactly what the dequantized weights give."""
    layer = load_random_fp8(fp8_module(dtype=torch.float32))
    assert layer.backend == "torch"
    x = torch.randn(5, 72, generator=torch.Generator().manual_seed(1))
    weights = layer.expert_weights()
    ids, topk_weights = route_torch(x @ layer.gate_weight.T, layer.routing)
    with torch.no_grad():
        assert_close(layer(x), fused_experts_torch(x, *weights.dequantized(), ids, topk_weights),
                     torch.float32)


@pytest.mark.parametrize("backend,platform,dtype,reason", [
    ("triton", Platform("cuda", (8, 0)), torch.bfloat16, "SM89 or newer"),
    ("flashinfer_cutlass", Platform("cuda", (9, 0), "0.7.2.post1"), torch.bfloat16,
     "does not run fp8"),
    ("triton", Platform("cpu", interpreter=True), torch.float32, "not float32"),
])
def test_fp8_layer_rejects_what_cannot_run_it_at_construction(backend, platform, dtype, reason):
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot run on .*{reason}"):
        fp8_module(backend, platform=platform, dtype=dtype)


def test_fp8_on_an_older_gpu_auto_says_why():
    # auto's default, triton, cannot take it: fail closed
    with pytest.raises(ValueError, match="SM89 or newer"):
        fp8_module("auto", platform=Platform("cuda", (8, 0)), dtype=torch.bfloat16)


# ---- on the H200 (pytest -m gpu): real shapes, compiled kernels, graphs -------------------------

GPU_TOKENS = [1, 4, 64, 512, 4096]


# one shape's weights at a time: DeepSeek-V3's FP8 experts are 11 GB
@functools.lru_cache(maxsize=1)
def gpu_weights(shape_name: str, fmt: WeightFormat) -> ExpertWeights:
    from moe_triton.tools.bench import GRID_SHAPES, random_experts

    torch.cuda.empty_cache()
    w13, w2 = random_experts(GRID_SHAPES[shape_name], torch.bfloat16, "cuda")
    return ExpertWeights(w13, w2).to_format(fmt)


def emulation_by_expert(x, weights, ids, topk_weights, block_n):
    """`emulation`, one expert's dequantized weights at a time (real shapes do not fit in float32 at
    once)."""
    out = torch.zeros(x.shape[0], weights.hidden_size, device=x.device)
    for e in torch.unique(ids[(ids >= 0) & (ids < weights.num_experts)]).tolist():
        mask = ids == e
        local = torch.where(mask, 0, -1).int()  # this expert as expert 0, everything else filtered
        out += emulation(x, weights.expert(e), local, torch.where(mask, topk_weights, 0.0), block_n)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
@pytest.mark.parametrize("shape_name,name",
                         [(s, "block128")
                          for s in ("Qwen3-30B-A3B", "Mixtral-8x7B", "DeepSeek-V3", "E64-K4")]
                         + [("Qwen3-30B-A3B", n)
                            for n in ("block16x16", "channel", "tensor", "tensor-static")])
def test_fp8_experts_on_the_gpu(shape_name, name, T):
    from moe_triton import choose_config
    from moe_triton.tools.bench import GRID_SHAPES, random_inputs

    shape, fmt = GRID_SHAPES[shape_name], FORMATS[name]
    weights = gpu_weights(shape_name, WeightFormat.fp8_tensor() if fmt.static_input else fmt)
    if fmt.static_input:
        weights = ExpertWeights(weights.w13, weights.w2, True, fmt, weights.w13_scale,
                                weights.w2_scale,
                                torch.tensor([4.5 / 448], device="cuda"))
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    out = run_experts(x, weights, ids, topk_weights)
    config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size,
                           torch.device("cuda"), torch.float8_e4m3fn,
                           fp8_group=fmt.block[1] if fmt.block else 128)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    emulated = emulation_by_expert(x, weights, ids, topk_weights, config.up.block_n)
    worst = ((out.float() - emulated).abs().max() / emulated.abs().max()).item()
    rms = ((out.float() - emulated).square().mean().sqrt() / emulated.square().mean().sqrt()).item()
    print(f"\n{shape_name} {name} T={T}: max error {worst:.2e} of max|emulation|, relative RMS "
          f"{rms:.2e}")
    assert worst <= GPU_EMULATION_MAX_TOL and rms <= GPU_EMULATION_RMS_TOL, config.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_fp8_graph_replay_equals_eager_and_outputs_are_fresh(T):
    from moe_triton.graphs import capture_graph
    from moe_triton.tools.bench import GRID_SHAPES, random_inputs

    shape = GRID_SHAPES["Qwen3-30B-A3B"]
    weights = gpu_weights("Qwen3-30B-A3B", FORMATS["block128"])
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=2, seed=7)
    outputs = {}

    def step(i):
        outputs[i] = run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                                 inputs.topk_weights[i])

    eager = [run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                         inputs.topk_weights[i])
             for i in range(2)]
    graph = capture_graph(step, 2)
    graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        assert torch.equal(outputs[i], eager[i])  # bit-stable: no atomics anywhere on the FP8 path
    assert outputs[0].data_ptr() != outputs[1].data_ptr()  # each call its own fresh output
    inputs_before = [t.clone() for t in (inputs.hidden_states[0], weights.w13, weights.w13_scale)]
    run_experts(inputs.hidden_states[0], weights, inputs.topk_ids[0], inputs.topk_weights[0])
    for before, after in zip(inputs_before,
                             (inputs.hidden_states[0], weights.w13, weights.w13_scale),
                             strict=True):
        assert torch.equal(
            before.view(torch.uint8) if before.dtype == torch.float8_e4m3fn else before,
            after.view(torch.uint8) if after.dtype == torch.float8_e4m3fn else after)


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
def test_fp8_narrow_blocks_on_the_gpu_match_the_dequantized_reference(T):
    """16 x 16 blocks (the demo's) at a real size in bf16, compiled: the 32-wide steps that scale
    each 16-column group within them, against float32 math on the dequantized weights."""
    from moe_triton.tools.bench import GRID_SHAPES, random_inputs

    shape = GRID_SHAPES["Qwen3-30B-A3B"]
    weights = gpu_weights("Qwen3-30B-A3B", FORMATS["block16x16"])
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    out = run_experts(x, weights, ids, topk_weights)
    reference = fused_experts_torch(x, *weights.dequantized(), ids, topk_weights)
    rms = ((out.float() - reference).square().mean() / reference.square().mean()).sqrt().item()
    print(f"\n16x16 blocks T={T}: relative RMS {rms:.3f} against the dequantized reference")
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and rms <= FP8_RMS_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 64, 1024])  # one pair per tile; decode tiles; prefill tiles
@pytest.mark.parametrize("source,name", NAN_CASES, ids=lambda v: v.replace(" ", "-"))
def test_fp8_nan_rows_on_the_gpu(source, name, T):
    """test_fp8_nan_rows_match_the_dequantized_reference compiled, in bf16: there the tensor cores'
    own NaN handling carries an e4m3 NaN weight through the dot."""
    sizes = dict(E=64, K=4, H=1024, I=512)
    x, weights, ids, topk_weights = nan_layer(name, source, T, "cuda", torch.bfloat16, **sizes)
    out = run_experts(x, weights, ids, topk_weights)
    check_nan(out, x, weights, ids, topk_weights, source)


@pytest.mark.gpu
def test_fp8_config_under_32_columns_is_refused_on_the_gpu():
    x, weights, ids, topk_weights = fp8_layer(FORMATS["block16x16"], 4, device="cuda",
                                              dtype=torch.bfloat16)
    narrow = MoEConfig(GemmConfig(16, 32, 16), GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match="config.up.block_c=16: FP8 GEMMs on a GPU step at least"):
        run_experts(x, weights, ids, topk_weights, config=narrow)


@pytest.mark.gpu
def test_fp8_layer_on_the_gpu_resolves_to_triton():
    layer = FusedMoE(8, 2, 256, 128, weight_format=FORMATS["block128"], dtype=torch.bfloat16,
                     device="cuda")
    assert layer.backend == "triton" and layer.gate_up_proj.dtype == torch.float8_e4m3fn
