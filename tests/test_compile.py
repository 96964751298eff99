"""torch.compile and torch.export over the layer's registered ops (moe_triton::route, ::experts).

On CPU the ops run their Triton kernels under the interpreter (float16: its bf16 dot is refused).
The compile checks use the "aot_eager" backend (dynamo and AOTAutograd, which run the fake
implementations and count graphs and recompiles the same way) except one inductor run; the GPU
checks, reduce-overhead and the transformers generate benchmark run on the H200 (@pytest.mark.gpu).
"""
import pytest
import torch
import torch._dynamo
from helpers import assert_close, copy_experts_
from torch._dynamo.utils import counters

from moe_triton import (
    ExpertWeights,
    FusedMoE,
    Placement,
    RoutingSpec,
    Scoring,
    SharedCombination,
    WeightFormat,
    fused_experts,
    route,
    run_experts,
)
from moe_triton.parallel import ParallelGroups, ParallelSpec

E, K, H, I = 8, 2, 32, 24
TOKENS = (1, 3, 17)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def make_layer(shared=False, fmt=WeightFormat(), routing=RoutingSpec(K, renormalize=True), seed=0,
               device="cpu",
               dtype=torch.float16):
    layer = FusedMoE(E, routing.top_k, H, I, routing=routing, weight_format=fmt, dtype=dtype,
                     device=device,
                     shared_experts=(torch.nn.Linear(H, H, device=device).to(dtype) if shared
                                     else None),
                     shared_combination=SharedCombination.AVERAGE, placement=Placement("triton"))
    g = torch.Generator().manual_seed(seed)
    native = ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / H**0.5,
                           torch.randn(E, H, I, generator=g) / I**0.5)
    weights = native if fmt.fp8 is None else native.to_format(fmt)
    copy_experts_(layer, weights)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randn(E, H, generator=g))
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.3)
    layer.prepare_weights()
    return layer


def token_batches(device="cpu", dtype=torch.float16):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(T, H, generator=g).to(device, dtype) for T in TOKENS]
    for x in batches:  # the token count is a dynamic size, 1 included (no 0/1 specialisation)
        torch._dynamo.decorators.mark_unbacked(x, 0)
    return batches


@pytest.mark.parametrize("variant", ["plain", "shared-experts", "biased-sigmoid", "fp8-block"])
def test_layer_compiles_into_one_graph_for_every_token_count(variant):
    kwargs = {"plain": {}, "shared-experts": dict(shared=True),
              "fp8-block": dict(fmt=WeightFormat.fp8_block(32, 32)),
              "biased-sigmoid": dict(routing=RoutingSpec(K, Scoring.SIGMOID, renormalize=True,
                                                         correction_bias=True,
                                                         routed_scaling_factor=2.0))}[variant]
    layer = make_layer(**kwargs)
    batches = token_batches()
    explanation = torch._dynamo.explain(layer)(batches[1])
    assert (explanation.graph_break_count == 0
            and explanation.graph_count == 1), explanation.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for x in batches:
            assert torch.equal(compiled(x), layer(x))  # the same kernels run: bit-equal
    assert counters["stats"]["unique_graphs"] == 1  # one compilation for T in {1, 3, 17}


def grads_of(forward, x, grad_out, parameters) -> list:
    """The gradients of (forward(x) . grad_out) for x and `parameters`, read off and cleared."""
    x = x.clone().requires_grad_()
    forward(x).backward(grad_out)
    grads = [x.grad] + [p.grad for p in parameters]
    for p in parameters:
        p.grad = None
    return grads


@pytest.mark.parametrize("variant", ["plain", "biased-sigmoid"])
def test_layer_compiles_with_gradients(variant):
    """Grad mode, the parameters requiring grad (a model's default): forward and backward compiled,
    the gradients of eager (the backward graph may reorder float32 sums: fp16 tolerance)."""
    routing = {"plain": RoutingSpec(K, renormalize=True),
               "biased-sigmoid": RoutingSpec(K, Scoring.SIGMOID, renormalize=True,
                                             correction_bias=True)}[variant]
    layer = make_layer(shared=True, routing=routing)
    parameters = list(layer.parameters())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    for T in (3, 17):
        x, grad_out = torch.randn(T, H, generator=g).half(), torch.randn(T, H, generator=g).half()
        eager = grads_of(layer, x, grad_out, parameters)
        for got, expected in zip(grads_of(compiled, x, grad_out, parameters), eager, strict=True):
            assert expected is not None and got is not None
            assert_close(got, expected.float(), torch.float16)


@pytest.mark.gpu
def test_the_layer_compiles_exports_and_runs_reduce_overhead_on_the_gpu_in_bf16():
    """The CPU checks again on the H200, in bf16 (refused under the interpreter) and with inductor's
    own codegen (on CPU it costs ~40 s of C++ compile): one graph, one compilation over T in {1, 3,
    17}, export; then mode="reduce-overhead" (CUDA graphs through compile)."""
    layer = make_layer(shared=True, device="cuda", dtype=torch.bfloat16)
    batches = token_batches("cuda", torch.bfloat16)
    explanation = torch._dynamo.explain(layer)(batches[1])
    assert (explanation.graph_break_count == 0
            and explanation.graph_count == 1), explanation.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        for x in batches:
            # inductor may fuse the shared expert
            assert_close(compiled(x), layer(x).float(), torch.bfloat16)
    assert counters["stats"]["unique_graphs"] == 1
    program = torch.export.export(layer, (batches[2],),
                                  dynamic_shapes=({0: torch.export.Dim("T")},))
    torch._dynamo.reset()
    overhead = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for x in batches:
            assert torch.equal(program.module()(x), layer(x))
        for _ in range(3):  # reduce-overhead records its graph on a later call
            for x in batches:
                assert_close(overhead(x), layer(x).float(), torch.bfloat16)


@pytest.mark.gpu
def test_the_layer_compiles_with_gradients_under_inductor_on_the_gpu_in_bf16():
    """test_layer_compiles_with_gradients with inductor's codegen, bf16 on CUDA: forward and
    backward at T = 3 and 17, gradients within bf16 of eager's (inductor fuses the router's and the
    shared expert's bf16 ops differently). The router runs in float32, so that no near tie of bf16
    logits picks other experts under inductor than in eager."""
    layer = make_layer(shared=True, device="cuda", dtype=torch.bfloat16,
                       routing=RoutingSpec(K, renormalize=True, router_in_float32=True))
    parameters = list(layer.parameters())
    compiled = torch.compile(layer, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    for T in (3, 17):
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        grad_out = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        eager = grads_of(layer, x, grad_out, parameters)
        for got, expected in zip(grads_of(compiled, x, grad_out, parameters), eager, strict=True):
            assert_close(got, expected.float(), torch.bfloat16, scale=2)


@pytest.mark.gpu
def test_transformers_model_with_moe_triton_experts_compiles_on_the_gpu_in_bf16(tmp_path):
    from helpers import all_sparse_qwen3_moe_checkpoint
    from transformers import AutoModelForCausalLM

    # Every token picks all 8 experts: with a top-2 of 8, a near tie in the router rounds
    # differently under inductor's fused bf16 norms than in eager and flips an expert for a token
    # (measured on the H200: one token's logits off by 0.1), a real discontinuity rather than a
    # compile error.
    path = all_sparse_qwen3_moe_checkpoint(tmp_path, num_experts_per_tok=8)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton",
                                                 dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    forward = lambda i: model(i, use_cache=False).logits  # noqa: E731
    explanation = torch._dynamo.explain(forward)(torch.randint(0, 97, (1, 7), device="cuda"))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True, dynamic=True)
    with torch.no_grad():
        # Not length 1: torch specializes a dimension of size 1 under dynamic=True (its 0/1 rule,
        # for any model), and duck sizing would tie a length of 2 to the batch of 2: lengths 3, 5,
        # 17 (6 to 34 tokens).
        for length in (3, 5, 17):
            ids = torch.randint(0, 97, (2, length), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(length))
            # two layers of bf16
            assert_close(compiled(ids), forward(ids).float(), torch.bfloat16, scale=2)
    assert counters["stats"]["unique_graphs"] == 1


def test_functional_entry_points_compile():
    g = torch.Generator().manual_seed(2)
    w13, w2 = (torch.randn(E, 2 * I, H, generator=g).half() / 6,
               torch.randn(E, H, I, generator=g).half() / 5)
    spec = RoutingSpec(K, renormalize=True)

    def layer(x, logits):
        ids, weights = route(logits, spec)
        return fused_experts(x, w13, w2, ids, weights)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x, logits = torch.randn(5, H, generator=g).half(), torch.randn(5, E, generator=g)
    assert torch.equal(compiled(x, logits), layer(x, logits))
    # out= writes a caller's buffer: not under compile
    with pytest.raises(Exception, match="are eager tools"):
        torch.compile(lambda x, ids, w: run_experts(x, ExpertWeights(w13, w2), ids, w,
                                                    out=torch.empty_like(x)),
                      fullgraph=True, backend="aot_eager")(x, *route(logits, spec))


def test_export_round_trip_with_a_dynamic_token_count():
    layer = make_layer(shared=True)
    x = token_batches()[2]
    program = torch.export.export(layer, (x,), dynamic_shapes=({0: torch.export.Dim("T")},))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert {"moe_triton.route.default", "moe_triton.experts.default"} <= targets, targets
    with torch.no_grad():
        for x in token_batches():
            assert torch.equal(program.module()(x), layer(x))


def test_a_sharded_layer_refuses_to_compile_and_says_why():
    # never reaches a collective
    groups = ParallelGroups(ParallelSpec(ep_size=2), 0, None, None, None)
    layer = FusedMoE(E, K, H, I, placement=Placement("torch", parallel=groups), dtype=torch.float16)
    for fullgraph in (True, False):  # not a silent graph break either
        torch._dynamo.reset()
        with pytest.raises(Exception, match="moe_triton.parallel .* is not compile-safe"):
            torch.compile(layer, fullgraph=fullgraph, backend="aot_eager")(torch.randn(3, H).half())


def test_transformers_model_with_moe_triton_experts_compiles(tmp_path):
    from helpers import all_sparse_qwen3_moe_checkpoint
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton",
                                                 dtype=torch.float16).eval()
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
    explanation = torch._dynamo.explain(lambda i: model(i, use_cache=False).logits)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(lambda i: model(i, use_cache=False).logits, fullgraph=True,
                             backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids), eager)


def test_transformers_model_with_moe_triton_experts_compiles_with_gradients(tmp_path):
    """The default for a transformers model (parameters requiring grad, grad mode on), compiled and
    differentiated: loss and every parameter's gradient as in eager."""
    from helpers import all_sparse_qwen3_moe_checkpoint
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_triton",
                                                 dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    loss = lambda i: model(i, labels=i, use_cache=False).loss  # noqa: E731
    grads = {}
    for name, forward in (("eager", loss),
                          ("compiled", torch.compile(loss, fullgraph=True, backend="aot_eager"))):
        model.zero_grad()
        forward(ids).backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, expected in grads["eager"].items():
        assert_close(grads["compiled"][name], expected, torch.float32, scale=10)


# every family traces the same way (one run each by hand)
@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_model_decode_step_compiles_into_one_graph(family, tmp_path):
    from helpers import FAMILIES, prompt, randomize_

    from moe_triton.models import load_model

    make, seed = FAMILIES[family]
    torch.manual_seed(0)
    randomize_(make().eval(), seed=seed).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float16)
    model.setup(max_batch=2, max_seq=32)
    ids = prompt()
    model.prefill(ids)
    step = {"token_ids": ids[:, -1], "positions": torch.full((2,), ids.shape[1]),
            "slots": torch.arange(2)}
    explanation = torch._dynamo.explain(model.decode_step)(step)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = model.decode_step(step)  # rewrites the same cache entries the compiled step writes
    compiled = torch.compile(model.decode_step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(step), eager)
