"""fused_experts: the whole Triton layer against the float32 torch reference; on the GPU, in bf16 at
real sizes."""
from dataclasses import replace

import pytest
import torch
from helpers import assert_close, random_expert_weights, random_ids, relative_error

from moe_triton import (
    SILU_AND_MUL,
    Activation,
    ActivationKind,
    ExpertWeights,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    WeightFormat,
    activate,
    activation_torch,
    choose_config,
    expand_torch,
    finalize_torch,
    fused_experts,
    fused_experts_torch,
    run_experts,
)
from moe_triton.expand import expand
from moe_triton.finalize import finalize
from moe_triton.routing import RoutingSpec, route, route_torch
from moe_triton.tools.bench import MIXTRAL_8X7B, QWEN3_30B_A3B, random_experts, random_inputs


def make_layer(T, E, K, H, I, dtype, seed, activation=Activation(), filtered=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13, w2 = random_expert_weights(g, E, H, I, activation.gated, dtype)
    ids = random_ids(T, K, E, seed, filtered).int()
    weights = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, weights


def config_for(layout: LayoutKind) -> MoEConfig:
    return MoEConfig(GemmConfig(16, 32, 32, group_m=2), GemmConfig(16, 32, 16), layout)


# fp16 intermediates are rounded once between the GEMMs; the reference keeps float32 throughout.
# PER_PAIR makes one tile per pair: the interpreter runs it at decode-like sizes only (T = 3: up
# to 24 one-pair tiles, already past the P^2 <= E that choose_config sends there; 17 took a minute
# a case on a busy 2-core machine).
# BY_EXPERT at 64 tokens: up to 64 pairs an expert, in 16-row tiles (its loop over them)
@pytest.mark.parametrize("T,layout", [(T, LayoutKind.SORTED) for T in (0, 1, 3, 17, 64)]
                         + [(T, LayoutKind.PER_PAIR) for T in (0, 1, 3)]
                         + [(T, LayoutKind.BY_EXPERT) for T in (1, 17, 64)], ids=str)
# K = E (every expert for every token, the slowest cases under the interpreter) once a dtype: 4-4
# in fp16 (pairs filtered), 8-8 in float32
@pytest.mark.parametrize("E,K,dtype", [(E, K, dtype) for E, K in [(1, 1), (4, 1), (4, 2), (4, 4),
                                                                  (8, 2), (8, 8)]
                                       for dtype in (torch.float32, torch.float16)
                                       if (E, K, dtype) not in [(4, 4, torch.float32),
                                                                (8, 8, torch.float16)]], ids=str)
def test_fused_experts(T, E, K, dtype, layout, poisoned_empty):
    # one data set a case (two were 2 minutes of the suite); a fifth of the fp16 cases' pairs
    # filtered, none of the float32 ones'
    filtered = 0.2 if dtype == torch.float16 else 0.0
    x, w13, w2, ids, weights = make_layer(T, E, K, H=40, I=33, dtype=dtype,
                                          seed=T + 7 * E + 31 * K, filtered=filtered)
    out = fused_experts(x, w13, w2, ids, weights, config=config_for(layout))
    assert out.shape == (T, 40) and out.dtype == dtype
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights), dtype, scale=2)


def test_by_expert_layout_with_down_split_along_c(poisoned_empty):
    """Each GEMM program finds its expert's pairs (40 of 80 here: three 16-row tiles), the down
    GEMM's float32 partials summed by finalize, a fifth of the pairs filtered."""
    x, w13, w2, ids, weights = make_layer(40, 2, 2, H=40, I=96, dtype=torch.float16, seed=3,
                                          filtered=0.2)
    config = MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 16, split_c=2),
                       LayoutKind.BY_EXPERT)
    assert_close(fused_experts(x, w13, w2, ids, weights, config=config),
                 fused_experts_torch(x, w13, w2, ids, weights), torch.float16, scale=2)


@pytest.mark.parametrize("T,E,K,H,I", [(17, 4, 2, 72, 961), (3, 8, 8, 100, 96)])
def test_fused_experts_awkward_widths(T, E, K, H, I, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(T, E, K, H, I, torch.float16, seed=T)
    assert_close(fused_experts(x, w13, w2, ids, weights),
                 fused_experts_torch(x, w13, w2, ids, weights), torch.float16, scale=2)


@pytest.mark.parametrize("activation", [
    Activation(ActivationKind.SILU_AND_MUL), Activation(ActivationKind.GELU_AND_MUL),
    Activation(ActivationKind.GELU_TANH_AND_MUL), Activation(ActivationKind.RELU2),
    Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5, swiglu_alpha=1.702),
], ids=lambda a: a.kind.name)
def test_fused_experts_activations(activation, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 8, 2, 40, 33, torch.float32, seed=3,
                                          activation=activation)
    out = fused_experts(x, w13, w2, ids, weights, activation=activation)
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights, activation=activation),
                 torch.float32)


# Split-C (split-K) of the second GEMM: float32 partials per C slice, summed by finalize. Slices
# that do not divide the C steps (3 into 5 steps of 16 for I=65) leave a short or empty slice,
# which must still store zeros; filtered ids must stay unread.
# Each epilogue in both dtypes but the non-gated one (gating is what the split must not break).
CLAMPED = Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=0.5, swiglu_alpha=1.702)


@pytest.mark.parametrize("splits", [2, 3, 8], ids=lambda s: f"down{s}")
@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
@pytest.mark.parametrize("activation,dtype", [
    (Activation(ActivationKind.SILU_AND_MUL), torch.float32),
    (Activation(ActivationKind.SILU_AND_MUL), torch.float16),
    (Activation(ActivationKind.RELU2), torch.float16),
    (CLAMPED, torch.float32),
    (CLAMPED, torch.float16),
], ids=lambda a: a.kind.name if isinstance(a, Activation) else str(a).split(".")[-1])
def test_split_c(splits, layout, activation, dtype, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(5, 8, 2, 40, 65, dtype, seed=7, activation=activation,
                                          filtered=0.2)
    config = MoEConfig(GemmConfig(16, 32, 32, group_m=2), GemmConfig(16, 32, 16, split_c=splits),
                       layout)
    out = fused_experts(x, w13, w2, ids, weights, activation=activation, config=config)
    assert out.dtype == dtype
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights, activation=activation), dtype,
                 scale=2)


def test_split_c_is_bit_stable(poisoned_empty):
    x, w13, w2, ids, weights = make_layer(9, 8, 2, 64, 96, torch.float16, seed=8)
    config = MoEConfig(GemmConfig(16, 32, 16), GemmConfig(16, 32, 16, split_c=3))
    assert torch.equal(fused_experts(x, w13, w2, ids, weights, config=config),
                       fused_experts(x, w13, w2, ids, weights, config=config))


@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
def test_filtered_ids_contribute_nothing(layout, poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 8, 4, 40, 33, torch.float32, seed=4, filtered=0.3)
    ids[0] = -1  # a token whose every slot is filtered gets zeros
    weights[(ids < 0) | (ids >= 8)] = float("nan")  # a filtered slot's weight is never read
    assert (ids == -1).any() and (ids == 8).any()
    out = fused_experts(x, w13, w2, ids, weights, config=config_for(layout))
    assert torch.equal(out[0], torch.zeros(40))
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights.nan_to_num()), torch.float32)


def test_output_is_fresh_and_input_unchanged():
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=5)
    inputs = [t.clone() for t in (x, w13, w2, ids, weights)]
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.data_ptr() not in {t.data_ptr() for t in (x, w13, w2, ids, weights)}
    for before, after in zip(inputs, (x, w13, w2, ids, weights), strict=True):
        assert torch.equal(before, after)


def test_non_contiguous_inputs(poisoned_empty):
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=6)
    x_strided = torch.randn(40, 17).T  # column-major (T, H)
    x_strided.copy_(x)
    ids64 = ids.long().T.contiguous().T  # int64, transposed storage
    weights_strided = weights.T.contiguous().T
    out = fused_experts(x_strided, w13, w2, ids64, weights_strided)
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights), torch.float32)


def plan_of(x, w13, w2, ids, weights):
    import moe_triton.pipeline as pipeline
    from moe_triton import ExpertWeights

    signature = pipeline._call_signature(x, ExpertWeights(w13, w2), ids, weights, SILU_AND_MUL,
                                         None, None)
    return pipeline._PLANS.get(signature)


def test_one_plan_serves_every_call_of_a_signature(poisoned_empty):
    """Later calls with fresh tensors of one signature reuse its plan and still compute their own
    data."""
    plans = []
    for seed in (11, 12, 13):
        x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=seed)
        assert_close(fused_experts(x, w13, w2, ids, weights),
                     fused_experts_torch(x, w13, w2, ids, weights), torch.float32)
        plans.append(plan_of(x, w13, w2, ids, weights))
    assert plans[0] is not None and plans[0] is plans[1] is plans[2]


def test_strides_are_part_of_the_signature():
    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=14)
    column_major = x.T.contiguous().T
    for hidden_states in (x, column_major):
        assert_close(fused_experts(hidden_states, w13, w2, ids, weights),
                     fused_experts_torch(x, w13, w2, ids, weights), torch.float32)
    assert plan_of(x, w13, w2, ids, weights) is not plan_of(column_major, w13, w2, ids, weights)


def test_plans_do_not_keep_weights_alive():
    """A plan is a signature's, not a tensor's: deleting a layer's weights frees them."""
    import gc
    import weakref

    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=16)
    fused_experts(x, w13, w2, ids, weights)
    assert plan_of(x, w13, w2, ids, weights) is not None
    alive = [weakref.ref(w13), weakref.ref(w2)]
    del w13, w2
    gc.collect()
    assert all(ref() is None for ref in alive)


@pytest.mark.parametrize("fmt", [None, WeightFormat.fp8_block(16, 16)],
                         ids=["bf16-like", "fp8-block"])
@pytest.mark.parametrize("T", [1, 9, 300], ids=["per-pair", "by-expert", "sorted"])
def test_the_plan_is_built_from_the_signature_before_anything_launches(T, fmt, no_launch):
    """plan_experts plans every stage itself, launching nothing: a frozen plan, one field per
    stage."""
    import dataclasses

    from moe_triton.expand import ExpandPlan, UnsortedPlan
    from moe_triton.pipeline import plan_experts

    x, w13, w2, ids, weights = make_layer(T, 4, 2, 32, 16, torch.float16, seed=T)
    experts = (ExpertWeights(w13, w2) if fmt is None
               else ExpertWeights(w13.float(), w2.float()).to_format(fmt))
    plan = plan_experts(x, experts, ids, weights, activation=SILU_AND_MUL, config=None, out=None)
    assert [f.name for f in dataclasses.fields(plan)][-6:] == ["expand", "quantize", "up", "down",
                                                               "decode", "finalize"]
    assert plan.decode is None  # choose_config takes the decode kernel on GPUs only
    # the layout by the pairs: one token's alone; up to 512 found by each GEMM program; sorted
    kind = {1: LayoutKind.PER_PAIR, 9: LayoutKind.BY_EXPERT}.get(T)
    assert (plan.expand.kind if isinstance(plan.expand, UnsortedPlan) else None) == kind
    assert isinstance(plan.expand, ExpandPlan) == (kind is None)
    assert (plan.quantize is not None) == (fmt is not None)
    assert all(stage.launch is not None for stage in (plan.up, plan.down, plan.finalize))
    assert plan.up.out_dtype == (torch.float8_e4m3fn if fmt else torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.up = plan.down


def test_bad_input_is_refused_after_its_shape_was_planned():
    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=15)
    fused_experts(x, w13, w2, ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w13, w2, ids.float(), weights)
    with pytest.raises(ValueError, match="out"):
        fused_experts(x, w13, w2, ids, weights, out=torch.empty(9, 40, dtype=torch.float16))


def test_empty_batch_launches_nothing(no_launch):
    x, w13, w2, ids, weights = make_layer(0, 4, 2, 40, 33, torch.float32, seed=0)
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.shape == (0, 40)


def _bad(**changes):
    x, w13, w2, ids, weights = make_layer(3, 4, 2, 16, 8, torch.float32, seed=0)
    args = dict(hidden_states=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)
    args.update({k: v(args) if callable(v) else v for k, v in changes.items()})
    return args


@pytest.mark.parametrize("args,match", [
    (_bad(hidden_states=lambda a: a["hidden_states"][None]), "hidden_states"),
    (_bad(hidden_states=lambda a: a["hidden_states"].double()), "hidden_states"),
    (_bad(w13=lambda a: a["w13"].half()), "w13"),
    (_bad(w13=lambda a: a["w13"][:, :, :8]), "w13"),
    (_bad(w13=lambda a: a["w13"][:0], w2=lambda a: a["w2"][:0]), "E=0"),
    (_bad(w13=lambda a: a["w13"][:, :15]), "w13"),
    (_bad(w2=lambda a: a["w2"][:, :, :4]), "w2"),
    (_bad(topk_ids=lambda a: a["topk_ids"].float()), "topk_ids"),
    (_bad(topk_ids=lambda a: a["topk_ids"][:2]), "topk_ids"),
    (_bad(topk_ids=lambda a: a["topk_ids"][:, :0], topk_weights=lambda a: a["topk_weights"][:, :0]),
     "top_k"),
    (_bad(topk_weights=lambda a: a["topk_weights"][:, :1]), "topk_weights"),
    (_bad(topk_weights=lambda a: a["topk_ids"]), "topk_weights"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_raises_before_launch(args, match, no_launch):
    with pytest.raises(ValueError, match=match):
        fused_experts(**args)


def test_nan_hidden_states_stay_in_their_rows():
    x, w13, w2, ids, weights = make_layer(17, 4, 2, 40, 33, torch.float32, seed=7)
    x[3] = float("nan")
    out = fused_experts(x, w13, w2, ids, weights)
    assert out[3].isnan().all()
    others = torch.ones(17, dtype=torch.bool)
    others[3] = False
    assert not out[others].isnan().any()

# ---- gradients: the op's backward against autograd through the float32 reference ----------------
# The backward recomputes each expert's rows in float32 from the inputs and rounds each gradient
# once, to its input's dtype: fp16 gradients sit within fp16's tolerance of the float32 reference.

def reference_grads(x, w13, w2, ids, weights, grad_out, activation=SILU_AND_MUL):
    """Autograd through fused_experts_torch on float32 copies: (d x, d w13, d w2, d weights)."""
    leaves = [t.detach().float().requires_grad_() for t in (x, w13, w2, weights)]
    out = fused_experts_torch(leaves[0], leaves[1], leaves[2], ids, leaves[3],
                              activation=activation)
    grads = torch.autograd.grad(out, leaves, grad_out.float(), allow_unused=True)
    return [torch.zeros_like(t) if grad is None else grad
            for t, grad in zip(leaves, grads, strict=True)]


def grad_layer(T, E, K, dtype, seed, activation=SILU_AND_MUL, filtered=0.0):
    """make_layer's tensors requiring grad, with ids drawn with repeats when K > E, and a
    grad_out."""
    x, w13, w2, ids, weights = make_layer(T, E, min(K, E), 40, 33, dtype, seed, activation,
                                          filtered)
    g = torch.Generator().manual_seed(seed)
    # an expert-parallel shard's view: more slots than local experts, others' ids filtered
    if K > E:
        ids = torch.randint(-1, E + 1, (T, K), generator=g).int()
        weights = torch.rand(T, K, generator=g)
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights)]
    return leaves, ids, torch.randn(T, 40, generator=g).to(dtype)


GRAD_CASES = {"T1": (1, 4, 2, 0.0), "T17-filtered": (17, 8, 2, 0.3), "K>E": (9, 3, 5, 0.0)}


@pytest.mark.parametrize("activation",
                         [Activation(ActivationKind.SILU_AND_MUL),
                          Activation(ActivationKind.RELU2)], ids=lambda a: a.kind.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_fused_experts_gradients(case, dtype, activation):
    T, E, K, filtered = GRAD_CASES[case]
    (x, w13, w2, weights), ids, grad_out = grad_layer(T, E, K, dtype, seed=T, activation=activation,
                                                      filtered=filtered)
    out = fused_experts(x, w13, w2, ids, weights, activation=activation)
    assert out.grad_fn is not None
    grads = torch.autograd.grad(out, (x, w13, w2, weights), grad_out)
    expected = reference_grads(x, w13, w2, ids, weights, grad_out, activation)
    for name, grad, ref, leaf in zip(("x", "w13", "w2", "topk_weights"), grads, expected,
                                     (x, w13, w2, weights), strict=True):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close(grad, ref, dtype, scale=2)


@pytest.mark.parametrize("activation", [Activation(ActivationKind.GELU_TANH_AND_MUL),
                                        Activation(ActivationKind.CLAMPED_SWIGLU,
                                                   swiglu_limit=0.5)],
                         ids=lambda a: a.kind.name)
def test_run_experts_gradients(activation):
    (x, w13, w2, weights), ids, grad_out = grad_layer(17, 8, 2, torch.float32, seed=5,
                                                      activation=activation, filtered=0.2)
    out = run_experts(x, ExpertWeights(w13, w2, activation.gated), ids, weights,
                      activation=activation)
    grads = torch.autograd.grad(out, (x, w13, w2, weights), grad_out)
    for grad, ref in zip(grads, reference_grads(x, w13, w2, ids, weights, grad_out, activation),
                         strict=True):
        assert_close(grad, ref, torch.float32)


def test_gradients_of_an_empty_batch():
    (x, w13, w2, weights), ids, grad_out = grad_layer(0, 4, 2, torch.float32, seed=0)
    out = fused_experts(x, w13, w2, ids, weights)
    assert out.shape == (0, 40) and out.grad_fn is not None
    grads = torch.autograd.grad(out, (x, w13, w2, weights), grad_out)
    assert all(grad.shape == t.shape and not grad.any()
               for grad, t in zip(grads, (x, w13, w2, weights), strict=True))


def test_only_the_gradients_needed_are_computed(monkeypatch):
    import moe_triton.pipeline as pipeline

    asked, real = [], pipeline.fused_experts_backward_torch
    monkeypatch.setattr(pipeline, "fused_experts_backward_torch",
                        lambda *a, **k: asked.append(k["needs"]) or real(*a, **k))
    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=2)
    x.requires_grad_()  # frozen experts, fixed routing weights
    grad_out = torch.randn(9, 40)
    fused_experts(x, w13, w2, ids, weights).backward(grad_out)
    assert asked == [(True, False, False, False, False, False)]  # x, w13, w2, weights, biases
    assert_close(x.grad, reference_grads(x, w13, w2, ids, weights, grad_out)[0], torch.float32)


class OpsSeen(torch.utils._python_dispatch.TorchDispatchMode):
    """The ATen and custom ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def test_inference_takes_the_planned_path_not_the_op():
    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=3)
    with OpsSeen() as ops:
        out = fused_experts(x, w13, w2, ids, weights)  # grad mode on, nothing requires grad
        with torch.no_grad():
            # the weights do, grad mode off
            fused_experts(x, w13.requires_grad_(), w2, ids, weights)
    assert "moe_triton.experts.default" not in ops.seen and out.grad_fn is None
    with OpsSeen() as ops:  # the spy sees the op where it runs
        fused_experts(x, w13, w2, ids, weights)
    assert "moe_triton.experts.default" in ops.seen


@pytest.mark.parametrize("tool", ["out", "config"])
def test_eager_tools_refuse_when_gradients_are_needed(tool, no_launch):
    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=4)
    kwargs = {"out": dict(out=torch.empty(9, 40)),
              "config": dict(config=config_for(LayoutKind.SORTED))}[tool]
    with pytest.raises(ValueError, match="have no backward") as refusal:
        fused_experts(x, w13.requires_grad_(), w2, ids, weights, **kwargs)
    assert "\n" not in str(refusal.value)


def test_capture_refuses_gradients(no_launch):
    from moe_triton.graphs import capture_mode

    x, w13, w2, ids, weights = make_layer(9, 4, 2, 40, 33, torch.float32, seed=4)
    with capture_mode(), pytest.raises(ValueError,
                                       match="cannot be captured in a CUDA graph") as refusal:
        fused_experts(x.requires_grad_(), w13, w2, ids, weights)
    assert "\n" not in str(refusal.value)


def test_fp8_gradients_are_straight_through():
    """x and topk_weights get the gradient of the dequantized float32 layer (the activations'
    quantization counts as the identity); e4m3 weights and their scales get none."""
    g = torch.Generator().manual_seed(6)
    E, K, H, I, T = 4, 2, 64, 32, 9
    fp8 = ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / 8,
                        torch.randn(E, H, I, generator=g) / 6
                        ).to_format(WeightFormat.fp8_block(32, 32))
    # as FusedMoE holds them
    tensors = [torch.nn.Parameter(t) for t in (fp8.w13, fp8.w2, fp8.w13_scale, fp8.w2_scale)]
    x = torch.randn(T, H, generator=g).half().requires_grad_()  # the interpreter's FP8 dtype
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    weights = torch.rand(T, K, generator=g).requires_grad_()
    out = run_experts(x, ExpertWeights(tensors[0], tensors[1], True, fp8.format, tensors[2],
                                       tensors[3]), ids, weights)
    grad_out = torch.randn(T, H, generator=g).half()
    grads = torch.autograd.grad(out, (x, weights, *tensors), grad_out, allow_unused=True)
    assert all(grad is None for grad in grads[2:])
    expected = reference_grads(x, *fp8.dequantized(), ids, weights, grad_out)
    assert_close(grads[0], expected[0], torch.float16)
    assert_close(grads[1], expected[3], torch.float16)


# ---- on the GPU (pytest -m gpu): bf16 at real sizes ----------------------------------------------
# Shapes: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768) and Mixtral-8x7B (E=8, K=2, H=4096, I=14336).
# bf16 operands with float32 accumulation: intermediates are rounded to bf16 (8 mantissa bits) once
# between the GEMMs, so the layer's relative error against the float32 reference sits near 2^-9;
# we allow 1e-2 in norm (METHOD: bf16 lands between 1e-3 and 1e-2).
GPU_TOKENS = [1, 8, 64, 512, 4096]


@pytest.fixture(scope="module", params=[QWEN3_30B_A3B, MIXTRAL_8X7B], ids=lambda s: s.name)
def real_layer(request):
    """Real-size bf16 experts on the GPU; built only when a gpu test asks for them."""
    shape = request.param
    return shape, *random_experts(shape, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
def test_layer_bf16(real_layer, T):
    shape, w13, w2 = real_layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    out = fused_experts(x, w13, w2, ids, weights)
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, ref) < 1e-2
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512])
@pytest.mark.parametrize("activation",
                         [Activation(ActivationKind.RELU2),
                          Activation(ActivationKind.GELU_TANH_AND_MUL),
                          Activation(ActivationKind.CLAMPED_SWIGLU, swiglu_limit=7.0,
                                     swiglu_alpha=1.702)],
                         ids=lambda a: a.kind.name)
def test_activations_bf16_and_nan_rows(real_layer, activation, T):
    """The non-SiLU epilogues compiled, at real size; a NaN token stays in its own row (relu^2 and
    the clamped swiglu once dropped it through max / min: tests/test_errors.py has the CPU case)."""
    shape, w13, w2 = real_layer
    if not activation.gated:
        w13 = w13[:, : shape.intermediate_size].contiguous()  # [E, I, H]: relu^2 has no gate half
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0].clone(), inputs.topk_ids[0], inputs.topk_weights[0]
    out = fused_experts(x, w13, w2, ids, weights, activation=activation)
    assert not out.isnan().any()
    assert relative_error(out,
                          fused_experts_torch(x, w13, w2, ids, weights,
                                              activation=activation)) < 1e-2
    x[0, 0] = float("nan")
    poisoned = fused_experts(x, w13, w2, ids, weights, activation=activation)
    assert poisoned[0].isnan().all() and not poisoned[1:].isnan().any()
    assert torch.equal(poisoned[1:], out[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("T", GPU_TOKENS)
def test_stages_bf16(real_layer, T, poisoned_empty):
    shape, w13, w2 = real_layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    ids, weights = inputs.topk_ids[0], inputs.topk_weights[0]
    # routing
    logits = torch.randn(T, shape.num_experts, device="cuda")
    spec = RoutingSpec(shape.top_k, renormalize=True)
    got_ids, got_w = route(logits, spec)
    ref_ids, ref_w = route_torch(logits, spec)
    differ = ((got_ids.sort(dim=1).values != ref_ids.sort(dim=1).values.int()).any(dim=1)
              .nonzero().flatten())
    assert differ.numel() == 0, (f"rows {differ[:4].tolist()}: ids {got_ids[differ[:4]].tolist()} "
                                 f"vs {ref_ids[differ[:4]].tolist()}, scores "
                                 f"{logits[differ[:4]].softmax(-1).tolist()}")
    assert_close(got_w.sort(dim=1).values, ref_w.sort(dim=1).values, torch.float32)
    # expand
    layout = expand(ids, shape.num_experts, 16)
    expected = expand_torch(ids.cpu(), shape.num_experts, 16)
    rows = int(layout.num_rows.item())
    assert torch.equal(layout.sorted_pair_ids[:rows].cpu(), expected["sorted_pair_ids"])
    assert torch.equal(layout.pair_to_row.cpu(), expected["pair_to_row"])
    # activation (standalone kernel)
    gate_up = torch.randn(T * shape.top_k, 2 * shape.intermediate_size, device="cuda",
                          dtype=torch.bfloat16)
    assert relative_error(activate(gate_up), activation_torch(gate_up, SILU_AND_MUL)) < 1e-2
    # finalize
    y = torch.randn(layout.max_rows, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert relative_error(finalize(y, weights, layout),
                          finalize_torch(y, weights, layout.pair_to_row, shape.top_k)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 4096])
def test_persistent_form_on_the_gpu(real_layer, T):
    """The persistent expert GEMMs (one program per SM over the rows in use) compute each tile as
    the one-program-per-tile grid does: the same bits, bf16 and FP8 block-128, and bf16 within
    its tolerance of the float32 reference."""
    from moe_triton.platform import device_limits

    shape, w13, w2 = real_layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    native = ExpertWeights(w13, w2)
    programs = device_limits(x.device)[0]
    for weights in (native, native.to_format(WeightFormat.fp8_block(128, 128))):
        config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                               shape.intermediate_size, x.device, weights.dtype)
        persistent = replace(config, up=replace(config.up, persistent_programs=programs),
                             down=replace(config.down, persistent_programs=programs))
        out = run_experts(x, weights, ids, topk_weights, config=persistent)
        assert torch.equal(out, run_experts(x, weights, ids, topk_weights, config=config))
        if weights is native:
            assert relative_error(out, fused_experts_torch(x, w13, w2, ids, topk_weights)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 4], ids=lambda s: f"down{s}")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_split_c_bf16(real_layer, T, splits):
    """Split-C partials (float32) on the compiled kernels, TMA weight tiles, both layouts."""
    shape, w13, w2 = real_layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size,
                           shape.intermediate_size, torch.device("cuda"),
                           down_split=splits)  # tiles fitted to shared memory
    for layout in LayoutKind:
        out = fused_experts(x, w13, w2, ids, weights, config=replace(config, layout=layout))
        assert (out.dtype == torch.bfloat16
                and relative_error(out, ref) < 1e-2), (layout, relative_error(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512])
def test_planned_calls_bf16(real_layer, T):
    """After a signature's first call the stages launch directly (launch.py): fresh inputs, a second
    set of weights of the same shape (its own TMA descriptors), and an unaligned hidden_states view
    (which the direct launch hands back to the JIT) all match the reference."""
    shape, w13, w2 = real_layer
    other = (w13[torch.randperm(shape.num_experts, device="cuda")].contiguous(),
             w2[torch.randperm(shape.num_experts, device="cuda")].contiguous())
    H = shape.hidden_size
    for i in range(4):
        inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=100 + i)
        x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
        if i == 3:
            # 2 bytes off
            x = torch.empty(T * H + 1, device="cuda", dtype=torch.bfloat16)[1:].view(T, H).copy_(x)
        for experts in ((w13, w2), other):
            out = fused_experts(x, *experts, ids, weights)
            assert relative_error(out,
                                  fused_experts_torch(x, *experts, ids, weights)) < 1e-2, (i, T)


@pytest.mark.gpu
def test_fp32_operands_use_ieee_dot():
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.float32, "cuda")
    inputs = random_inputs(shape, 64, torch.float32, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    assert relative_error(fused_experts(x, w13, w2, ids, weights),
                          fused_experts_torch(x, w13, w2, ids, weights)) < 1e-5


@pytest.mark.gpu
def test_layer_is_graph_capturable():
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    inputs = random_inputs(shape, 8, torch.bfloat16, "cuda", num_variants=2)
    static = [t.clone()
              for t in (inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0])]
    fused_experts(*static[:1], w13, w2, *static[1:])  # warm-up compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(static[0], w13, w2, static[1], static[2])
    for i in range(2):  # different routing each replay: no stale state
        for buf, new in zip(static,
                            (inputs.hidden_states[i], inputs.topk_ids[i], inputs.topk_weights[i]),
                            strict=True):
            buf.copy_(new)
        graph.replay()
        ref = fused_experts_torch(static[0], w13, w2, static[1], static[2])
        assert relative_error(out, ref) < 1e-2


# bf16 gradients at a real size: the backward recomputes in float32 from the bf16 inputs, so each
# gradient differs from the float32 reference by its one rounding to bf16 (2^-9 relative) and the
# order of float32 sums: well inside 1e-2 in norm.
GRAD_SHAPE = dict(E=64, K=8, H=1024, I=512, T=512)


def real_grad_layer(dtype=torch.bfloat16, seed=0):
    E, K, H, I, T = GRAD_SHAPE.values()
    g = torch.Generator().manual_seed(seed)
    w13, w2 = random_expert_weights(g, E, H, I, dtype=dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = random_ids(T, K, E, seed, filtered=0.05).int()
    weights = torch.rand(T, K, generator=g)
    grad_out = torch.randn(T, H, generator=g).to(dtype)
    return [t.cuda() for t in (x, w13, w2, ids, weights, grad_out)]


@pytest.mark.gpu
def test_gradients_bf16_at_a_real_size():
    x, w13, w2, ids, weights, grad_out = real_grad_layer()
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights)]
    grads = torch.autograd.grad(fused_experts(x, w13, w2, ids, weights), leaves, grad_out)
    expected = reference_grads(x, w13, w2, ids, weights, grad_out)
    for name, grad, ref, leaf in zip(("x", "w13", "w2", "topk_weights"), grads, expected, leaves,
                                     strict=True):
        assert grad.dtype == leaf.dtype and not grad.isnan().any(), name
        assert relative_error(grad, ref) < 1e-2, (name, relative_error(grad, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [WeightFormat.fp8_block(128, 128), WeightFormat.fp8_channel()],
                         ids=["block128", "channel"])
def test_fp8_straight_through_gradients_bf16_at_a_real_size(fmt):
    """As on CPU (test_fp8_gradients_are_straight_through), at a real size on the FP8 kernels."""
    x, w13, w2, ids, weights, grad_out = real_grad_layer()
    fp8 = ExpertWeights(w13, w2).to_format(fmt)
    x.requires_grad_()
    weights.requires_grad_()
    grads = torch.autograd.grad(run_experts(x, fp8, ids, weights), (x, weights), grad_out)
    expected = reference_grads(x, *fp8.dequantized(), ids, weights, grad_out)
    assert relative_error(grads[0], expected[0]) < 1e-2
    assert relative_error(grads[1], expected[3]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 1024])
@pytest.mark.parametrize("fmt", [None, WeightFormat.fp8_block(128, 128)], ids=["bf16", "fp8"])
def test_eager_layer_calls_never_sync_the_host(real_layer, fmt, T):
    """An eager call queues its kernels and returns: no host sync (torch's sync debug mode), from
    the second call of a signature on (the first plans, and Triton compiles)."""
    from helpers import no_host_sync

    shape, w13, w2 = real_layer
    experts = ExpertWeights(w13, w2) if fmt is None else ExpertWeights(w13, w2).to_format(fmt)
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    expected = run_experts(x, experts, ids, weights)
    with no_host_sync():
        out = run_experts(x, experts, ids, weights)
        empty = run_experts(x[:0], experts, ids[:0], weights[:0])
    assert torch.equal(out, expected) and empty.shape == (0, shape.hidden_size)
