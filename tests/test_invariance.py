"""invariance.py: inside `batch_invariant()` a token's output has the same bits alone, inside its
batch and inside a shuffled batch with other tokens, for run_experts and FusedMoE (its router
included); outside it the layer is shown not to be, so the check can fail. Under the interpreter
in float32 / fp16 / FP8, and on the H200 at the Qwen3 grid shape in bf16 and FP8."""
from functools import partial

import pytest
import torch
from helpers import (
    copy_experts_,
    prompt,
    random_expert_weights,
    random_ids,
    rows_that_depend_on_the_batch,
    test_device,
)

from moe_triton import (
    ExpertWeights,
    FusedMoE,
    Placement,
    RoutingSpec,
    WeightFormat,
    batch_invariant,
    run_experts,
)

TOKENS = [1, 2, 7, 37, 64]
E, K, H, I = 8, 2, 64, 32


def rows_alone(T: int) -> list[int]:
    """The tokens run alone: both of a batch of two, else the first, a middle and the last (each
    alone call is a full layer call under the interpreter)."""
    return sorted({0, T // 2, T - 1})


def differing_rows(call, T: int, extra: int, seed: int) -> list[str]:
    """call(indices) runs the tokens at `indices` as one batch. Where token t's row of the batch
    of tokens 0..T-1 differs from the same token alone, or placed at random among T + `extra`
    tokens: an empty list means invariant."""
    full = call(torch.arange(T))
    order = torch.randperm(T + extra, generator=torch.Generator().manual_seed(seed))
    mixed = call(order)
    at = order.argsort()  # where token t went
    bad = [f"token {t} in the shuffled batch" for t in range(T)
           if not torch.equal(mixed[at[t]], full[t])]
    return bad + [f"token {t} alone" for t in rows_alone(T)
                  if not torch.equal(call(torch.tensor([t]))[0], full[t])]


def tiny_layer(dtype, fmt=WeightFormat()) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, routing=RoutingSpec(K, renormalize=True), weight_format=fmt,
                     dtype=dtype, placement=Placement("triton"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randn(E, H, generator=g))
    weights = ExpertWeights(*random_expert_weights(g, E, H, I))
    copy_experts_(layer, weights if fmt.fp8 is None else weights.to_format(fmt))
    return layer.to(test_device())


def tokens(T: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(test_device(),
                                                                               dtype)


# every T in float32; fp16 and FP8 (whose experts take fp16 activations here) at two
LAYER_CASES = ([(T, torch.float32, WeightFormat()) for T in TOKENS]
               + [(T, torch.float16, fmt) for T in (1, 7)
                  for fmt in (WeightFormat(), WeightFormat.fp8_block(32, 32))])


@pytest.mark.parametrize("T,dtype,fmt", LAYER_CASES,
                         ids=lambda v: "fp8" if getattr(v, "fp8", None) else str(v))
def test_the_layer_s_rows_do_not_depend_on_the_batch(T, dtype, fmt):
    layer, x = tiny_layer(dtype, fmt), tokens(T + 9, dtype, T)
    with torch.no_grad(), batch_invariant():
        assert differing_rows(lambda rows: layer(x[rows.to(x.device)]), T, 9, T) == []


def test_outside_the_mode_the_router_s_rows_depend_on_the_batch():
    """Shows the check above can fail: torch's float32 CPU matmul (the router's, outside the
    mode) rounds a row differently alone than in a batch of 64 (the GPU's split-K tiles: below)."""
    if test_device().type != "cpu":
        pytest.skip("the CPU's BLAS; the GPU's counterpart is the grid test below")
    layer, x = tiny_layer(torch.float32), tokens(64 + 9, torch.float32, 1)
    with torch.no_grad():
        assert differing_rows(lambda rows: layer(x[rows]), 64, 9, 1) != []


@pytest.mark.parametrize("T", TOKENS)
def test_given_experts_rows_do_not_depend_on_the_batch(T):
    """run_experts on given ids and weights: the expert GEMMs' tiles alone (no router)."""
    g = torch.Generator().manual_seed(T)
    device = test_device()
    weights = ExpertWeights(*(w.to(device) for w in random_expert_weights(g, E, H, I)))
    ids = random_ids(T + 9, K, E, seed=T).to(device)
    topk_weights = torch.rand(T + 9, K, generator=g).to(device)
    x = tokens(T + 9, torch.float32, T)

    def call(rows):
        rows = rows.to(device)
        return run_experts(x[rows], weights, ids[rows], topk_weights[rows])

    with batch_invariant():
        assert differing_rows(call, T, 9, T) == []


def test_the_mode_is_scoped_and_refuses_a_non_bool():
    from moe_triton.invariance import batch_invariant_enabled

    assert not batch_invariant_enabled()
    with batch_invariant():
        assert batch_invariant_enabled()
        with batch_invariant(False):
            assert not batch_invariant_enabled()
        assert batch_invariant_enabled()
    assert not batch_invariant_enabled()
    with pytest.raises(ValueError, match="True or False"), batch_invariant("yes"):
        pass


def test_a_backend_the_mode_does_not_cover_is_refused_before_anything_runs():
    """The torch reference's per-expert matmuls round a row by how many rows share its expert:
    inside the mode a layer on it is a ValueError naming the backend and the fix, not rows that
    silently differ."""
    layer = FusedMoE(E, K, H, I, routing=RoutingSpec(K), placement=Placement("torch"))
    refused = pytest.raises(ValueError, match=r"torch backend.*Placement\('triton'\)")
    with batch_invariant(), refused:
        layer(torch.zeros(3, H))
    assert layer(torch.zeros(3, H)).shape == (3, H)  # outside the mode it runs


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=str)
@pytest.mark.parametrize("name", ["minimax_m3", "nemotron_h-latent"])
def test_a_standalone_blocks_rows_do_not_depend_on_the_batch(name, dtype):
    """MiniMax-M3's and NemotronH's MoE blocks, shared experts and latent projections included
    (models/' Linear reads the mode), on the Triton experts: float32, and bf16 on the GPU."""
    from helpers import BLOCKS, randomize_all_

    from moe_triton.models import default_dtype

    _, weights = BLOCKS[name]()
    # built where and in what it runs: its backend resolves there, its router bias stays float32
    with torch.device(test_device()), default_dtype(dtype):
        _, block = BLOCKS[name]()
    assert block.backend == "triton"
    block.load_state_dict(randomize_all_(weights, seed=3).state_dict())
    block = block.eval()
    x = torch.randn(40, block.gate_weight.shape[1],
                    generator=torch.Generator().manual_seed(4)).to(test_device(), dtype)
    with torch.no_grad(), batch_invariant():
        assert differing_rows(lambda at: block(x[at][None])[0], 7, 33, seed=5) == []


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block128"])
def test_grid_size_rows_do_not_depend_on_the_batch_on_the_gpu(fmt):
    """Qwen3-30B-A3B's experts: rows alone (decode tiles, split-K) vs in 4096 tokens (prefill
    tiles) differ outside the mode and match bit for bit inside it."""
    from moe_triton.tools.bench import GRID_SHAPES, random_experts, random_inputs

    shape = GRID_SHAPES["Qwen3-30B-A3B"]
    weights = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
    if fmt != "bf16":
        weights = weights.to_format(WeightFormat.fp8_block(128, 128))
    inputs = random_inputs(shape, 4096, torch.bfloat16, "cuda", num_variants=1, seed=3)
    x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]

    def alone_vs_batch() -> list[int]:
        full = run_experts(x, weights, ids, topk_weights)
        return [T for T in TOKENS if not torch.equal(
            run_experts(x[:T], weights, ids[:T], topk_weights[:T]), full[:T])]

    assert alone_vs_batch() != []  # the default tiles follow T
    with batch_invariant():
        assert alone_vs_batch() == []


# ---- the models: attention, norms, rotary and the head too --------------------------------------

# -sum: average's code but a sum; gpt_oss: its published MXFP4 checkpoint (sinks, windows)
INVARIANT_FAMILIES = ["qwen3_moe", "cohere2_moe", "minimax_m2", "gpt_oss"]


def tiny_model(family: str, path, dtype: torch.dtype, device):
    """A tiny random checkpoint of `family` written to `path`, loaded back in `dtype` on `device`
    (on the Triton experts: the torch backend's per-expert matmuls take as many rows as the batch
    sends, not invariant), set up for a batch of 4 and 24 positions."""
    from helpers import FAMILIES, gpt_oss_checkpoint, randomize_, tiny_cohere2_moe

    from moe_triton.models import load_model

    if family == "gpt_oss":
        gpt_oss_checkpoint(path, mxfp4=True)
        model = load_model(path, dtype=dtype, device=device, backend="triton")
        model.setup(max_batch=4, max_seq=24)
        return model
    make, seed = FAMILIES[family]
    if family == "cohere2_moe":
        # its sliding and full attention in two layers, not four: each layer is an interpreted
        # Triton MoE call, and a row's bits alone vs batched hold or break layer by layer
        make = partial(tiny_cohere2_moe, layer_types=("sliding_attention", "full_attention"))
    torch.manual_seed(0)
    randomize_(make().eval(), seed=seed).save_pretrained(path)
    model = load_model(path, dtype=dtype, device=device)
    model.setup(max_batch=4, max_seq=24)
    return model


@pytest.fixture(scope="module", params=INVARIANT_FAMILIES)
def family_model(request, tmp_path_factory):
    """The family's tiny model in float32."""
    return tiny_model(request.param, tmp_path_factory.mktemp(request.param), torch.float32,
                      test_device())


def test_a_models_prefill_and_decode_give_a_sequence_the_same_bits_alone_and_batched(
        family_model):
    """helpers.rows_that_depend_on_the_batch: prefill logits alone vs among three, decode alone vs
    beside two sequences of other lengths, bitwise."""
    assert rows_that_depend_on_the_batch(family_model) == []


def test_outside_the_mode_a_decode_step_depends_on_its_batch(family_model):
    """The check above can fail: the default decode attention splits the context by the batch
    size (and torch's matmuls pick kernels by it), so the same sequence's step differs in bits."""
    if test_device().type != "cpu":
        pytest.skip("the CPU's split count and BLAS (the GPU's grid test covers the experts)")
    if family_model.config.model_type != "qwen3_moe":
        pytest.skip("one family shows it (the split and matmuls are every family's)")
    assert rows_that_depend_on_the_batch(family_model, mode=False, checks=("decode",)) == ["decode"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", INVARIANT_FAMILIES)
def test_a_bf16_models_prefill_and_decode_are_batch_invariant_on_the_gpu(family, tmp_path):
    """The same checks in bf16 on the H200: SDPA's prefill kernels, cuBLAS outside the mode."""
    model = tiny_model(family, tmp_path, torch.bfloat16, "cuda")
    assert rows_that_depend_on_the_batch(model) == []


@pytest.mark.parametrize("family_model", ["qwen3_moe"], indirect=True)
def test_greedy_tokens_alone_and_batched_are_the_same(family_model):
    """generate: one prompt's tokens alone and among three (qwen3: the decode path is the
    family-independent part; two tokens: prefill's and one decode step's)."""
    ids = prompt(3, 6, seed=2).to(test_device())
    with batch_invariant():
        batched = family_model.generate(ids, 2, eos_token_id=None)
        assert torch.equal(family_model.generate(ids[2:], 2, eos_token_id=None)[0], batched[2])


@pytest.mark.gpu
def test_decode_graphs_are_captured_in_the_mode_generate_runs_in(tmp_path):
    """Graphs bake the mode in at capture: generate inside batch_invariant() after a setup outside
    it captures them again, and a prompt's greedy tokens alone and batched then match, in bf16."""
    model = tiny_model("qwen3_moe", tmp_path, torch.bfloat16, "cuda")
    assert model.graphs is not None and not model.graphs_batch_invariant
    ids = prompt(3, 6, seed=2).cuda()
    with batch_invariant():
        batched = model.generate(ids, 6, eos_token_id=None)
        assert model.graphs_batch_invariant
        assert torch.equal(model.generate(ids[2:], 6, eos_token_id=None)[0], batched[2])
