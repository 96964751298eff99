"""The kernels and the whole layer in bf16 at real sizes, on the GPU (run: pytest -m gpu).

Shapes: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768) and Mixtral-8x7B (E=8, K=2, H=4096, I=14336).
bf16 operands with float32 accumulation: intermediates are rounded to bf16 (8 mantissa bits) once
between the GEMMs, so the layer's relative error against the float32 reference sits near 2^-9;
we allow 1e-2 in norm (METHOD: bf16 lands between 1e-3 and 1e-2).
"""
import pytest
import torch

from helpers import assert_close, relative_error
from moe_triton import (SILU_AND_MUL, activate, activation_torch, expand, expand_torch, finalize, finalize_torch, fused_experts,
                        fused_experts_torch)
from moe_triton.tools.bench import MIXTRAL_8X7B, QWEN3_30B_A3B, random_experts, random_inputs
from moe_triton.routing import RoutingSpec, route, route_torch

pytestmark = pytest.mark.gpu
TOKENS = [1, 8, 64, 512, 4096]


@pytest.fixture(scope="module", params=[QWEN3_30B_A3B, MIXTRAL_8X7B], ids=lambda s: s.name)
def layer(request):
    shape = request.param
    return shape, *random_experts(shape, torch.bfloat16, "cuda")


@pytest.mark.parametrize("T", TOKENS)
def test_layer_bf16(layer, T):
    shape, w13, w2 = layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    out = fused_experts(x, w13, w2, ids, weights)
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, ref) < 1e-2
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("T", TOKENS)
def test_stages_bf16(layer, T, poisoned_empty):
    shape, w13, w2 = layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    ids, weights = inputs.topk_ids[0], inputs.topk_weights[0]
    # routing
    logits = torch.randn(T, shape.num_experts, device="cuda")
    spec = RoutingSpec(shape.top_k, renormalize=True)
    got_ids, got_w = route(logits, spec)
    ref_ids, ref_w = route_torch(logits, spec)
    assert torch.equal(got_ids.sort(dim=1).values.cpu(), ref_ids.sort(dim=1).values.int().cpu())
    assert_close(got_w.sort(dim=1).values, ref_w.sort(dim=1).values, torch.float32)
    # expand
    layout = expand(ids, shape.num_experts, 16)
    expected = expand_torch(ids.cpu(), shape.num_experts, 16)
    rows = int(layout.num_rows.item())
    assert torch.equal(layout.sorted_pair_ids[:rows].cpu(), expected["sorted_pair_ids"])
    assert torch.equal(layout.pair_to_row.cpu(), expected["pair_to_row"])
    # activation (standalone kernel)
    gate_up = torch.randn(T * shape.top_k, 2 * shape.intermediate_size, device="cuda", dtype=torch.bfloat16)
    assert relative_error(activate(gate_up), activation_torch(gate_up, SILU_AND_MUL)) < 1e-2
    # finalize
    y = torch.randn(layout.max_rows, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert relative_error(finalize(y, weights, layout), finalize_torch(y, weights, layout.pair_to_row, shape.top_k)) < 1e-2


@pytest.mark.parametrize("splits", [1, 2, 3, 4], ids=lambda s: f"down{s}")
@pytest.mark.parametrize("T", [1, 4, 16])
def test_split_c_bf16(layer, T, splits):
    """Split-C partials (float32) on the compiled kernels, TMA weight tiles, both layouts."""
    from dataclasses import replace

    from moe_triton import LayoutKind, choose_config

    shape, w13, w2 = layer
    inputs = random_inputs(shape, T, torch.bfloat16, "cuda", num_variants=1, seed=T)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    ref = fused_experts_torch(x, w13, w2, ids, weights)
    config = choose_config(T, shape.top_k, shape.num_experts, shape.hidden_size, shape.intermediate_size,
                           torch.device("cuda"), down_split=splits)  # tiles fitted to shared memory
    for layout in LayoutKind:
        out = fused_experts(x, w13, w2, ids, weights, config=replace(config, layout=layout))
        assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 1e-2, (layout, relative_error(out, ref))


def test_fp32_operands_use_ieee_dot():
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.float32, "cuda")
    inputs = random_inputs(shape, 64, torch.float32, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    assert relative_error(fused_experts(x, w13, w2, ids, weights), fused_experts_torch(x, w13, w2, ids, weights)) < 1e-5


def test_layer_is_graph_capturable():
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    inputs = random_inputs(shape, 8, torch.bfloat16, "cuda", num_variants=2)
    static = [t.clone() for t in (inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0])]
    fused_experts(*static[:1], w13, w2, *static[1:])  # warm-up compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(static[0], w13, w2, static[1], static[2])
    for i in range(2):  # different routing each replay: no stale state
        for buf, new in zip(static, (inputs.hidden_states[i], inputs.topk_ids[i], inputs.topk_weights[i])):
            buf.copy_(new)
        graph.replay()
        ref = fused_experts_torch(static[0], w13, w2, static[1], static[2])
        assert relative_error(out, ref) < 1e-2
