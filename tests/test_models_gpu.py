"""models/ on the GPU: parity with transformers in bf16 and float32, generation through CUDA
graphs, overlap on vs off, and a race-forcing test that proves the inplace-free contract matters."""
import copy

import pytest
import torch

from helpers import FAMILIES, prompt, randomize_, relative_error
from moe_triton import fused_experts
from moe_triton.tools.bench import QWEN3_30B_A3B, random_experts, random_inputs
from moe_triton.graphs import run_branches
from moe_triton.models import load_model
from test_models import checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


def test_bf16_logits_match_transformers(checkpoint):
    # bf16 rounds every activation to 8 mantissa bits; through a few layers the logits drift by a
    # few 1e-3 relative: 3e-2 in norm leaves room without hiding a wrong kernel (those give O(1)).
    reference, path = checkpoint
    reference = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    ours = load_model(path, dtype=torch.bfloat16, device="cuda")
    ours.use_graphs = False
    ids = prompt().cuda()
    ours.setup(2, 32)
    with torch.no_grad():
        expected = reference(ids).logits
    assert relative_error(ours.prefill(ids), expected) < 3e-2


def test_float32_generation_through_graphs_matches_transformers(checkpoint):
    reference, path = checkpoint
    reference = copy.deepcopy(reference).to("cuda")
    ours = load_model(path, dtype=torch.float32, device="cuda")
    ids = prompt().cuda()
    expected = reference.generate(ids, max_new_tokens=16, do_sample=False)
    actual = ours.generate(ids, max_new_tokens=16)
    assert ours.graphs is not None and ours.graphs.stats.num_graphs > 0  # decode ran through graphs
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.startswith("cohere2_moe")])  # the overlapping family
def test_overlap_on_and_off_give_the_same_tokens(family, tmp_path, monkeypatch):
    import moe_triton.models.cohere2_moe as cohere
    import moe_triton.models.layers as layers

    make, seed = FAMILIES[family]
    torch.manual_seed(0)
    randomize_(make().eval(), seed=seed).save_pretrained(tmp_path)
    path = tmp_path

    calls = []
    spy = lambda *a, **k: calls.append(k.get("role", "alt")) or run_branches(*a, **k)  # noqa: E731
    monkeypatch.setattr(cohere, "run_branches", spy)  # attention || MLP
    monkeypatch.setattr(layers, "run_branches", spy)  # shared || routed
    tokens = {}
    for overlap in (False, True):
        model = load_model(path, dtype=torch.bfloat16, device="cuda")
        model.use_overlap = overlap
        calls.clear()
        tokens[overlap] = model.generate(prompt().cuda(), max_new_tokens=16)
        assert bool(calls) == overlap  # the overlapped path was captured only when asked for
    assert {"alt", "alt_mlp"} <= set(calls)
    assert torch.equal(tokens[True], tokens[False])


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace-output", "fresh-output"])
def test_race_inplace_output_corrupts_the_other_branch(inplace):
    """Branch A (alternate stream) is held back, then reads x; branch B writes its expert output.
    Written into x, B's output corrupts A's input; as a fresh tensor it cannot."""
    shape = QWEN3_30B_A3B
    w13, w2 = random_experts(shape, torch.bfloat16, "cuda")
    inputs = random_inputs(shape, 64, torch.bfloat16, "cuda", num_variants=1)
    x, ids, weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
    expected_side = (x.float() * 2).clone()

    def held_back_reader():
        torch.cuda._sleep(50_000_000)  # ~tens of ms on the side stream before reading x
        return x.float() * 2

    def writer():
        return fused_experts(x, w13, w2, ids, weights, out=x if inplace else None)

    fused_experts(x, w13, w2, ids, weights)  # compile first: a JIT pause would let the reader finish before the write
    torch.cuda.synchronize()
    _, side = run_branches(writer, held_back_reader, role="alt")
    torch.cuda.synchronize()
    if inplace:
        assert not torch.equal(side, expected_side), "the in-place write did not race: the test cannot fail"
    else:
        assert torch.equal(side, expected_side)
