"""Issue 18: no silent wrong answers, no raw tracebacks. One regression test per item of the issue:
each either checks a correct result or a ValueError (a clean exit 2 for the CLI) naming the
argument and the fix. tests/test_fuzz.py searches the same entry points at random."""
import json
import warnings

import pytest
import torch
from helpers import assert_close

import moe_triton
import moe_triton.platform as platforms
from moe_triton import (
    FusedMoE,
    GemmConfig,
    LayoutKind,
    MoEConfig,
    Placement,
    RoutingSpec,
    Scoring,
    SelectOn,
    fused_experts,
    fused_experts_torch,
    resolve,
    route,
    route_torch,
    softmax_topk,
)
from moe_triton.platform import Platform
from moe_triton.quant_config import QuantFormat
from moe_triton.runners import LayerTraits, ModelContext, experts_quantization
from moe_triton.tools.cli import main

CPU_INTERPRETED = Platform("cpu", interpreter=True)
CPU_PLAIN = Platform("cpu", interpreter=False)
SM100 = Platform("cuda", (10, 0), "0.7.2.post1")


def experts(T, E, K, H=16, I=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    weights = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, weights


# ---- bf16 on the Triton interpreter: refused, never computed wrongly -----------------------------

def test_auto_runs_bf16_layers_on_torch_under_the_interpreter():
    bf16 = LayerTraits(16, torch.bfloat16, moe_triton.SILU_AND_MUL, RoutingSpec(2))
    resolution = resolve("auto", CPU_INTERPRETED, ModelContext(), bf16)
    assert (resolution.backend == "torch" and "bfloat16" in resolution.reason
            and "interpreter" in resolution.reason)
    fp16 = LayerTraits(16, torch.float16, moe_triton.SILU_AND_MUL, RoutingSpec(2))
    assert resolve("auto", CPU_INTERPRETED, ModelContext(), fp16).backend == "triton"
    # the interpreter is on in the tests
    assert FusedMoE(4, 2, 16, 8, dtype=torch.bfloat16).backend == "torch"


def test_explicit_triton_with_bf16_on_the_interpreter_fails_at_construction():
    with pytest.raises(ValueError,
                       match=r"backend='triton' cannot run on CPU \(Triton interpreter "
                             r"on\).*bfloat16"):
        FusedMoE(4, 2, 16, 8, dtype=torch.bfloat16, placement=Placement("triton"))


def test_a_bf16_layer_computes_correctly_under_auto():
    layer = FusedMoE(4, 2, 16, 8, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x = torch.randn(5, 16, generator=g).bfloat16()
    ids, weights = route_torch(x.float() @ layer.gate_weight.float().T, layer.routing)
    assert_close(layer(x),
                 fused_experts_torch(x, layer.gate_up_proj, layer.down_proj, ids, weights), scale=2)


@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
def test_fused_experts_refuses_bf16_under_the_interpreter(layout, no_launch):
    x, w13, w2, ids, weights = experts(3, 4, 2, dtype=torch.bfloat16)
    config = MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32), layout)
    with pytest.raises(ValueError, match="bfloat16.*interpreter.*float16/float32.*torch"):
        fused_experts(x, w13, w2, ids, weights, config=config)


def test_the_bf16_refusal_of_fp8_experts_advises_the_dtype_they_take(no_launch):
    # Following the advice must not lead into a second refusal: FP8 experts refuse float32
    # activations.
    from moe_triton import ExpertWeights, WeightFormat, run_experts

    x, w13, w2, ids, weights = experts(3, 4, 2, dtype=torch.float32)
    fp8 = ExpertWeights(w13, w2).to_format(WeightFormat.fp8_block(16, 16))
    with pytest.raises(ValueError, match=r"interpreter's bfloat16 tl.dot .* use float16 on CPU"):
        run_experts(x.bfloat16(), fp8, ids, weights)
    with pytest.raises(ValueError, match="FP8 experts take bfloat16 or float16"):
        run_experts(x, fp8, ids, weights)


def test_bf16_through_experts_implementation_is_refused_on_the_interpreter(tmp_path):
    from helpers import all_sparse_qwen3_moe_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(all_sparse_qwen3_moe_checkpoint(tmp_path),
                                                 experts_implementation="moe_triton",
                                                 dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_bf16_routing_is_exact_under_the_interpreter():
    """Routing has no tl.dot: bf16 logits are upcast to float32 in the kernel, so under the
    interpreter they route bit-identically to the same logits given in float32."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 16, generator=g) * 3).bfloat16()
    bias = torch.rand(16, generator=g) * 0.1
    for spec, b in [(RoutingSpec(4, renormalize=True), None),
                    (RoutingSpec(2, Scoring.SOFTMAX, SelectOn.LOGITS), None),
                    (RoutingSpec(4, Scoring.SIGMOID, SelectOn.SCORES, True, 4, 2, 2.5,
                                 correction_bias=True), bias)]:
        ids, weights = route(logits, spec, b)
        ids_f32, weights_f32 = route(logits.float(), spec, b)
        assert torch.equal(ids, ids_f32) and torch.equal(weights, weights_f32)


# ---- out= ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [0, 3])
@pytest.mark.parametrize("out,match", [
    (lambda T: torch.empty(T + 2, 16), "shape"),
    (lambda T: torch.empty(T, 15), "shape"),
    (lambda T: torch.empty(T, 16, dtype=torch.int32), "dtype"),
    (lambda T: torch.empty(T, 16, dtype=torch.float16), "dtype"),
    (lambda T: torch.empty(T, 16, device="meta"), "device"),
    (lambda T: torch.empty(16, T).T, "stride"),
    (lambda T: [[0.0] * 16] * T, "tensor"),
], ids=["rows", "cols", "int32", "float16", "meta", "column-major", "list"])
def test_out_is_checked_before_any_launch(T, out, match, no_launch):
    x, w13, w2, ids, weights = experts(T, 4, 2)
    buffer = out(T)
    if T == 0 and match == "stride":
        pytest.skip("an empty (0, 16) buffer has no rows to stride over")
    with pytest.raises(ValueError, match=f"out.*{match}"):
        fused_experts(x, w13, w2, ids, weights, out=buffer)


def test_a_valid_out_is_filled_and_returned():
    x, w13, w2, ids, weights = experts(3, 4, 2)
    out = torch.full((3, 16), float("nan"))
    assert fused_experts(x, w13, w2, ids, weights, out=out) is out
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights))
    empty = torch.empty(0, 16)
    assert fused_experts(x[:0], w13, w2, ids[:0], weights[:0], out=empty) is empty


# ---- top-k larger than E: the expert-parallel sentinel case --------------------------------------

@pytest.mark.parametrize("T", [0, 1, 2, 5])
@pytest.mark.parametrize("layout", list(LayoutKind), ids=lambda k: k.value)
def test_top_k_above_num_experts_with_filtered_ids(T, layout):
    """256 experts over 64 ranks leave 4 local experts with top-8: the other ids are sentinels."""
    E, K = 4, 8
    x, w13, w2, _, weights = experts(T, E, K, seed=T)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-2, 2 * E, (T, K), generator=g, dtype=torch.int64)
    if T:
        ids[0, 0] = 2**40  # an int64 id beyond 2^31 is filtered, never wrapped into [0, E)
        ids[-1] = E  # a token with every slot filtered gets zeros
    config = MoEConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32), layout)
    out = fused_experts(x, w13, w2, ids, weights, config=config)
    assert out.shape == (T, 16)
    assert_close(out, fused_experts_torch(x, w13, w2, ids, weights))
    if T:
        assert torch.equal(out[-1], torch.zeros(16))


def test_top_k_above_num_experts_with_the_default_config():
    x, w13, w2, _, weights = experts(6, 2, 4)
    ids = torch.tensor([[0, 1, 2, 3]] * 6, dtype=torch.int32)
    assert_close(fused_experts(x, w13, w2, ids, weights),
                 fused_experts_torch(x, w13, w2, ids, weights))


def test_gpu_config_with_top_k_above_num_experts(monkeypatch):
    from moe_triton import choose_config
    from moe_triton import config as configs

    monkeypatch.setattr(configs, "device_limits", lambda device: (132, 232448))
    for T in (1, 2, 3, 8):
        # no ZeroDivisionError from (1 - K/E)^T
        choose_config(T, 8, 4, 64, 64, torch.device("cuda"))


# ---- raw errors where a clear one belongs --------------------------------------------------------

def test_routing_without_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*route_torch"):
        softmax_topk(torch.randn(3, 4), 2)


@pytest.mark.parametrize("call,match", [
    (lambda: softmax_topk(torch.randn(3, 4, device="meta"), 2), "meta"),
    (lambda: softmax_topk(torch.randn(3, 4), 2.5), "top_k"),
    (lambda: softmax_topk(torch.randn(3, 4), "2"), "top_k"),
    (lambda: softmax_topk(torch.randn(3, 4), True), "top_k"),
    (lambda: softmax_topk([[0.0, 1.0]], 1), "logits"),
    (lambda: softmax_topk(torch.randn(3, 4).to(torch.float8_e4m3fn), 2), "logits"),
    (lambda: moe_triton.grouped_topk(torch.randn(3, 8), torch.zeros(8), 2, 2.0, 1, True, 1.0),
     "n_group"),
    (lambda: moe_triton.grouped_topk(torch.randn(3, 8), torch.zeros(8), 2, 2, 1, True, "x"),
     "routed_scaling_factor"),
], ids=["meta", "float-top_k", "str-top_k", "bool-top_k", "list", "float8", "float-n_group",
        "str-scale"])
def test_routing_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fused_experts_on_meta_names_the_device():
    x, w13, w2, ids, weights = (t.to("meta") for t in experts(3, 4, 2))
    with pytest.raises(ValueError, match="meta"):
        fused_experts(x, w13, w2, ids, weights)


@pytest.mark.parametrize("args,match", [
    ((-1, 2, 16, 8), "num_experts"),
    ((4, 2, 0, 8), "hidden_size"),
    ((4, 2, 16, -8), "intermediate_size"),
    ((4, 2.0, 16, 8), "top_k"),
    ((4, 5, 16, 8), "top_k"),
    (("4", 2, 16, 8), "num_experts"),
])
def test_layer_sizes_are_positive_integers(args, match):
    with pytest.raises(ValueError, match=match):
        FusedMoE(*args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.int32), "dtype"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(dtype="bf16"), "dtype"),
    (dict(device="gpu"), "device"),
])
def test_layer_dtype_and_device(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedMoE(4, 2, 16, 8, **kwargs)
    # a dtype's name, as load_model
    assert FusedMoE(4, 2, 16, 8, dtype="float16").gate_up_proj.dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_layer_on_cuda_without_cuda():
    with pytest.raises(ValueError, match="device='cuda'.*no CUDA"):
        FusedMoE(4, 2, 16, 8, device="cuda")


def torch_layer(**kwargs):
    return FusedMoE(4, 2, 16, 8, placement=Placement("torch"), **kwargs)


@pytest.mark.parametrize("x,match", [
    ([1.0] * 16, "hidden_states"),
    (torch.randn(3, 5), "hidden_states.*16"),
    (torch.ones(3, 16, dtype=torch.int64), "hidden_states.*dtype"),
    (torch.randn(3, 16, device="meta"), "meta"),
    (torch.randn(()), "hidden_states"),
], ids=["list", "width", "int64", "meta", "scalar"])
def test_layer_forward_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        torch_layer()(x)


def test_layer_on_meta_says_how_to_materialize_it():
    layer = FusedMoE(4, 2, 16, 8, device="meta")
    with pytest.raises(ValueError, match="meta.*to_empty"):
        layer(torch.randn(3, 16, device="meta"))


def test_layer_empty_batch():
    layer = torch_layer()
    assert layer(torch.randn(0, 16)).shape == (0, 16)
    assert layer(torch.randn(2, 0, 16)).shape == (2, 0, 16)


# ---- checkpoints and models ---------------------------------------------------------------------

def test_a_misshapen_expert_tensor_is_named():
    from moe_triton.models.checkpoint import fuse_per_expert

    tensors = {f"m.experts.{e}.{proj}.weight": torch.zeros(4, 8) for e in range(3)
               for proj in ("gate_proj", "up_proj")}
    tensors["m.experts.2.up_proj.weight"] = torch.zeros(5, 8)
    with pytest.raises(ValueError,
                       match=r"m\.experts\.2\.up_proj\.weight has shape \(5, 8\).*\(4, 8\)"):
        fuse_per_expert(tensors)


@pytest.fixture(scope="module")
def tiny_model(qwen3_checkpoint):
    from moe_triton.models import load_model

    return load_model(qwen3_checkpoint, dtype=torch.float32)


def test_prefill_before_setup_says_to_call_setup(qwen3_checkpoint):
    from moe_triton.models import load_model

    model = load_model(qwen3_checkpoint, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"setup\("):
        model.prefill(torch.tensor([[1, 2, 3]]))


def test_calling_the_model_says_what_to_call(tiny_model):
    with pytest.raises(ValueError, match=r"generate\(.*prefill\("):
        tiny_model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("ids,new,match", [
    (torch.tensor([[1, 2]]), -1, "max_new_tokens"),
    (torch.tensor([[1, 2]]), 2.5, "max_new_tokens"),
    ([[1, 2]], 2, "input_ids"),
    (torch.tensor([[1.0, 2.0]]), 2, "input_ids"),
    (torch.tensor([[1, 97]]), 2, "input_ids.*vocab"),
    (torch.tensor([[-1, 2]]), 2, "input_ids.*vocab"),
    (torch.tensor([1, 2]), 2, "input_ids"),
])
def test_generate_bad_arguments(tiny_model, ids, new, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.generate(ids, new)


def test_generate_takes_integer_like_counts(tiny_model):
    import numpy as np

    ids = torch.tensor([[1, 2, 3]])
    expected = tiny_model.generate(ids, 2)
    assert torch.equal(tiny_model.generate(ids, np.int64(2)), expected)
    assert torch.equal(tiny_model.generate(ids, torch.tensor(2)), expected)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got True"):
        tiny_model.generate(ids, True)


def test_generate_more_tokens_than_memory_holds_is_refused_before_allocating(tiny_model):
    tiny_model.setup(1, 8)
    cache = tiny_model.cache
    with pytest.raises(ValueError,
                       match=r"^generate\(1 x 3 prompt tokens, max_new_tokens=1000000000000\) "
                             r"needs a KV cache of .* GiB .* free on cpu: ask for fewer new "
                             r"tokens \(config\.json's max_position_embeddings is \d+\)$"):
        tiny_model.generate(torch.tensor([[1, 2, 3]]), 10**12)
    assert tiny_model.cache is cache  # nothing was freed or allocated


@pytest.mark.parametrize("args,match", [
    ((2.5, 8), "max_batch must be an integer >= 1, got 2.5"),
    ((-1, 8), "max_batch must be an integer >= 1, got -1"),
    ((0, 8), "max_batch must be an integer >= 1, got 0"),
    ((True, 8), "max_batch must be an integer >= 1, got True"),
    ((2, "8"), "max_seq must be an integer >= 1, got '8'"),
    ((2, 0), "max_seq must be an integer >= 1, got 0"),
    ((2, 8, (1, 4)), r"batch_sizes must be integers in \[1, max_batch=2\], got \(1, 4\)"),
    ((2, 8, (0,)), r"batch_sizes must be integers in \[1, max_batch=2\]"),
    ((2, 8, ()), r"batch_sizes must be integers in \[1, max_batch=2\]"),
    ((2, 8, 3), r"batch_sizes must be integers in \[1, max_batch=2\], got 3"),
    ((10**9, 10**9),
     r"^setup\(1000000000, 1000000000\) needs a KV cache of .* GiB for 1000000000 x 1000000000 "
     r"tokens, more than the .* GiB free on cpu: ask for fewer sequences"),
])
def test_setup_sizes_are_refused_in_one_line(tiny_model, args, match):
    with pytest.raises(ValueError, match=match):
        tiny_model.setup(*args)


def test_setup_takes_integer_like_sizes(tiny_model):
    import numpy as np

    tiny_model.setup(np.int64(2), torch.tensor(5), batch_sizes=[np.int32(1), 2])
    assert (tiny_model.cache.max_batch, tiny_model.cache.max_seq) == (2, 5)


def test_ragged_prompts_as_a_nested_tensor_are_refused(tiny_model):
    ragged = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    with pytest.raises(ValueError,
                       match=r"input_ids is a nested \(ragged\) tensor: pass prompts of equal "
                             r"length"):
        tiny_model.generate(ragged, 2)


def decode_inputs(B=2, position=3, **changes):
    inputs = {"token_ids": torch.tensor([1, 2, 3][:B]), "positions": torch.full((B,), position),
              "slots": torch.arange(B)}
    return inputs | changes


@pytest.mark.parametrize("inputs,match", [
    (decode_inputs(position=8),
     r"^positions must lie in \[0, setup\(\)'s max_seq=8\), got values in \[8, 8\]: call "
     r"model\.setup\(max_batch, max_seq\) with a larger max_seq$"),
    (decode_inputs(positions=torch.tensor([3, 10**12])),
     r"positions must lie in \[0, setup\(\)'s max_seq=8\), got "
     r"values in \[3, 1000000000000\]"),
    (decode_inputs(positions=torch.tensor([-1, 2])),
     r"positions must lie in \[0, .*got values in \[-1, 2\]"),
    (decode_inputs(slots=torch.tensor([0, -1])),
     r"^slots must lie in \[0, setup\(\)'s max_batch=2\), got values in "
     r"\[-1, 0\]: call model\.setup\(max_batch, max_seq\) with a larger "
     "max_batch$"),
    (decode_inputs(slots=torch.tensor([0, 2])),
     r"slots must lie in \[0, setup\(\)'s max_batch=2\)"),  # the dummy
    (decode_inputs(token_ids=torch.tensor([1, 97])), r"token_ids must lie in \[0, vocab_size=97\)"),
    (decode_inputs(slots=torch.tensor([0.0, 1.0])),
     "decode_step's slots must be an int64/int32 tensor"),
    (decode_inputs(slots=torch.tensor([0, 1, 1])),
     r"decode_step's inputs must have one batch size, got token_ids \(2,\), "
     r"positions \(2,\), slots \(3,\)"),
    ({"token_ids": torch.tensor([1]), "positions": torch.tensor([1])},
     "decode_step takes a dict of exactly"),
    ([1, 2, 3], "decode_step takes a dict of exactly"),
])
def test_decode_step_refuses_inputs_outside_the_cache_before_writing(tiny_model, inputs, match):
    tiny_model.setup(2, 8)
    keys = [k.clone() for k in tiny_model.cache.keys]
    with pytest.raises(ValueError, match=match):
        tiny_model.decode_step(inputs)
    # nothing written
    assert all(torch.equal(a, b) for a, b in zip(tiny_model.cache.keys, keys, strict=True))


def test_decode_step_before_setup_says_to_call_setup(qwen3_checkpoint):
    from moe_triton.models import load_model

    with pytest.raises(ValueError, match=r"decode_step before setup\(\)"):
        load_model(qwen3_checkpoint, dtype=torch.float32).decode_step(decode_inputs())


def test_decode_step_in_bounds_matches_prefill(tiny_model):
    """The checked eager step: the token after a prompt, at its position, equals prefill over
    both."""
    tiny_model.setup(2, 8)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    tiny_model.prefill(ids[:, :3])
    logits = tiny_model.decode_step({"token_ids": ids[:, 3], "positions": torch.tensor([3, 3]),
                                     "slots": torch.arange(2)})
    assert_close(logits, tiny_model.prefill(ids)[:, 3], torch.float32)


def test_the_step_the_graphs_capture_records_no_autograd(tiny_model):
    """setup() captures the unchecked step outside any no_grad: it must not record a backward
    graph."""
    tiny_model.setup(2, 8)
    tiny_model.prefill(torch.tensor([[5, 6, 7], [9, 10, 11]]))
    with torch.enable_grad():
        logits = tiny_model._decode_step({"token_ids": torch.tensor([1, 2]),
                                          "positions": torch.tensor([3, 3]),
                                          "slots": torch.arange(2)})
    assert logits.grad_fn is None and not logits.requires_grad


@pytest.mark.parametrize("slots,match", [
    (torch.tensor([0, 2]),
     r"slots must lie in \[0, setup\(\)'s max_batch=2\), got values in \[0, 2\]"),
    (torch.tensor([-1, 0]),
     r"slots must lie in \[0, setup\(\)'s max_batch=2\), got values in \[-1, 0\]"),
    (torch.tensor([0]), r"slots must be an int64/int32 tensor of shape \(2,\)"),
])
def test_prefill_slots_are_checked(tiny_model, slots, match):
    tiny_model.setup(2, 8)
    with pytest.raises(ValueError, match=match):
        tiny_model.prefill(torch.tensor([[1, 2], [3, 4]]), slots)


def test_prefill_past_the_cache(tiny_model):
    tiny_model.setup(1, 4)
    with pytest.raises(ValueError, match=r"setup\("):
        tiny_model.prefill(torch.tensor([[1, 2, 3]] * 2))
    with pytest.raises(ValueError, match=r"setup\("):
        tiny_model.prefill(torch.tensor([[1, 2, 3, 4, 5]]))


def test_generate_zero_new_tokens_returns_the_prompt(tiny_model):
    assert torch.equal(tiny_model.generate(torch.tensor([[1, 2]]), 0), torch.tensor([[1, 2]]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.int32), "dtype"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype="not_a_dtype"), "dtype"),
    (dict(device="gpu"), "device"),
])
def test_load_model_bad_arguments(qwen3_checkpoint, kwargs, match):
    from moe_triton.models import load_model

    with pytest.raises(ValueError, match=match):
        load_model(qwen3_checkpoint, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_load_model_on_cuda_without_cuda():
    from moe_triton.models import load_model

    with pytest.raises(ValueError, match="device='cuda'.*no CUDA"):
        load_model("/nonexistent", device="cuda")


def test_load_model_given_the_safetensors_file_names_its_directory(qwen3_checkpoint):
    from pathlib import Path

    from moe_triton.models import load_model

    with pytest.raises(ValueError, match=f"pass its directory.*{Path(qwen3_checkpoint).name}"):
        load_model(Path(qwen3_checkpoint) / "model.safetensors")


def test_load_model_bf16_on_the_interpreter_runs_on_torch(qwen3_checkpoint):
    from moe_triton.models import load_model

    model = load_model(qwen3_checkpoint, dtype=torch.bfloat16)
    backends = {m.backend for m in model.modules() if isinstance(m, FusedMoE)}
    assert backends == {"torch"}
    assert model.generate(torch.tensor([[1, 2, 3]]), 2).shape == (1, 5)


# ---- the torch fallback says so ------------------------------------------------------------------

def fallback_warnings(build):
    from moe_triton.runners import resolver

    resolver.warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
        build()
    return [w for w in caught if "torch reference" in str(w.message)]


def test_from_transformers_warns_once_when_it_falls_back_to_torch(monkeypatch):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40,
                                                  num_experts=8, num_experts_per_tok=2))
    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: False)
    caught = fallback_warnings(lambda: moe_triton.from_transformers(block))
    assert len(caught) == 1 and "TRITON_INTERPRET=1" in str(caught[0].message)


def test_load_model_warns_once_when_it_falls_back_to_torch(qwen3_checkpoint, monkeypatch):
    from moe_triton.models import load_model

    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: False)
    caught = fallback_warnings(lambda: load_model(qwen3_checkpoint, dtype=torch.float32))
    assert len(caught) == 1


def test_demo_resolution_line_says_when_it_falls_back():
    from moe_triton.tools.demo import resolution_line

    fallback = resolve("auto", CPU_PLAIN)
    assert "the Triton kernels do not run" in resolution_line(fallback)
    assert "do not run" not in resolution_line(resolve("auto", CPU_INTERPRETED))


# ---- quantization configs: malformed means unreadable -------------------------------------------

NVFP4 = {"num_bits": 4, "type": "float", "group_size": 16}


@pytest.mark.parametrize("config", [
    {"quant_method": "modelopt", "quantization": "NVFP4"},
    {"quant_method": "modelopt", "quantization": {"quant_algo": 4}},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "quantization": {"quant_algo": "FP8"}},
    {"quant_method": ["modelopt"]},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": "Linear", "weights": NVFP4}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": [3], "weights": NVFP4}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": [None, "Linear"], "weights": NVFP4}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": ["re:[unclosed"], "weights": NVFP4}}},
    {"quant_method": "compressed-tensors", "config_groups": {"g": "Linear"}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": ["Linear"], "weights": "nvfp4"}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": ["Linear"], "format": 4}}},
    {"quant_method": "compressed-tensors", "format": ["nvfp4-pack-quantized"],
     "config_groups": {"g": {"targets": ["Linear"]}}},
    {"quant_method": "compressed-tensors", "ignore": "lm_head",
     "config_groups": {"g": {"targets": ["Linear"]}}},
    {"quant_method": "compressed-tensors", "ignore": [1],
     "config_groups": {"g": {"targets": ["Linear"]}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": ["Linear"], "weights": {**NVFP4, "num_bits": 4.0}}}},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"targets": ["Linear"], "weights": {**NVFP4, "num_bits": True}}}},
    {"quant_method": "compressed-tensors", "config_groups": []},
    [1, 2],
])
def test_malformed_quantization_configs_are_unreadable(config):
    assert experts_quantization(config).format is QuantFormat.UNREADABLE


def test_a_string_target_is_not_read_as_no_group_targeting_the_experts():
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "config_groups": {"g": {"targets": "Linear", "weights": NVFP4}}}
    resolution = resolve("auto", SM100, ModelContext("Cohere2MoeForCausalLM", config))
    assert resolution.backend == "triton" and "unreadable" in resolution.reason


# ---- the CLI: a clean exit 2 and one line --------------------------------------------------------

def cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def write_config(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config) if not isinstance(config, str)
                                          else config)
    return str(tmp_path)


@pytest.mark.parametrize("argv,match", [
    (["probe", "torch", "triton", "--tokens", "0"], "--tokens"),
    (["probe", "torch", "triton", "--tokens", "-3"], "--tokens"),
    (["probe", "torch", "triton", "--tolerance", "-1"], "--tolerance"),
    (["probe", "torch", "triton", "--tolerance", "nan"], "--tolerance"),
    (["probe", "torch", "triton", "--min-agreement", "1.5"], "--min-agreement"),
    (["probe", "torch", "nonsense"], "BACKEND"),
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--tokens", "-1"], "--tokens"),
    (["demo", "--tokens", "x"], "--tokens"),
    (["bench", "--tokens", "0"], "--tokens"),
    (["resolve", "MODEL", "--platform", "sm1000"], "sm1000"),
    (["resolve", "MODEL", "--platform", "sm100", "--all-to-all", "bogus"], "--all-to-all"),
    (["resolve", "MODEL/model.safetensors"], "directory"),
    (["frobnicate"], "frobnicate"),
    ([], "command"),
])
def test_cli_errors_exit_2_with_one_line(argv, match, tmp_path, capsys):
    model = write_config(tmp_path, {"architectures": ["Qwen3MoeForCausalLM"]})
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    code, _, err = cli(capsys, *(a.replace("MODEL", model) for a in argv))
    assert code == 2 and len(err) == 1, err
    assert match in err[0] and err[0].startswith("moe-triton")


@pytest.mark.parametrize("config", ['[1, 2]', '{"architectures": "Qwen3MoeForCausalLM"}',
                                    '{"architectures": [{"x": 1}]}'])
def test_cli_resolve_malformed_config_json(config, tmp_path, capsys):
    code, _, err = cli(capsys, "resolve", write_config(tmp_path, config))
    assert code == 2 and len(err) == 1 and "config.json" in err[0]


def test_cli_resolve_malformed_quantization_is_unreadable(tmp_path, capsys):
    model = write_config(tmp_path, {"architectures": ["Cohere2MoeForCausalLM"],
                                    "quantization_config": {"quant_method": "modelopt",
                                                            "quantization": "NVFP4"}})
    code, out, _ = cli(capsys, "resolve", model, "--platform", "sm100")
    assert code == 0 and "unreadable" in out and "backend:       triton" in out


@pytest.mark.parametrize("argv",
                         [["resolve", "MODEL"], ["probe", "torch", "triton"], ["bench"], ["demo"]])
def test_every_subcommand_restarts_under_the_interpreter_on_a_cpu_machine(argv, tmp_path, capsys,
                                                                          monkeypatch):
    import moe_triton.tools.cli as cli_module

    class Restarted(Exception):
        pass

    def execve(path, args, env):
        raise Restarted(args, env)

    monkeypatch.setattr(platforms, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_module.os, "execve", execve)
    argv = [a.replace("MODEL", write_config(tmp_path, {"architectures": ["Qwen3MoeForCausalLM"]}))
            for a in argv]
    with pytest.raises(Restarted) as restarted:
        main(argv)
    args, env = restarted.value.args
    assert args[-len(argv):] == argv and env["TRITON_INTERPRET"] == "1"


# ---- found by the fuzz test ----------------------------------------------------------------------

@pytest.mark.parametrize("activation",
                         [moe_triton.Activation(kind) for kind in moe_triton.ActivationKind],
                         ids=lambda a: a.kind.name)
def test_nan_hidden_states_stay_in_their_rows_for_every_activation(activation):
    """relu^2 and the clamped swiglu used max/min, which drop NaN: a NaN row came out as zeros."""
    x, _, _, ids, weights = experts(4, 4, 2)
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(4, 16 if activation.gated else 8, 16, generator=g) / 4
    w2 = torch.randn(4, 16, 8, generator=g) / 3
    x[1, 3] = float("nan")
    out = fused_experts(x, w13, w2, ids, weights, activation=activation)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    assert_close(out[[0, 2, 3]],
                 fused_experts_torch(x, w13, w2, ids, weights, activation=activation)[[0, 2, 3]])


@pytest.mark.parametrize("config,match", [
    (lambda: MoEConfig(GemmConfig(16, 24, 32), GemmConfig(16, 32, 32)), "block_n"),
    (lambda: MoEConfig(GemmConfig(16, 32, 8), GemmConfig(16, 32, 32)), "block_c"),
    (lambda: MoEConfig(GemmConfig(12, 32, 32), GemmConfig(12, 32, 32), LayoutKind.PER_PAIR),
     "block_m"),
    (lambda: MoEConfig(GemmConfig(16, 32, 32, num_warps=3), GemmConfig(16, 32, 32)), "num_warps"),
    (lambda: "fast", "config"),
])
def test_launch_configs_are_checked(config, match, no_launch):
    x, w13, w2, ids, weights = experts(3, 4, 2)
    with pytest.raises(ValueError, match=match):
        fused_experts(x, w13, w2, ids, weights, config=config())


def test_activation_must_be_an_activation(no_launch):
    x, w13, w2, ids, weights = experts(3, 4, 2)
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, w13, w2, ids, weights, activation="silu")


def test_a_config_transformers_rejects_is_a_one_line_value_error(qwen3_checkpoint, tmp_path):
    """Found by the fuzz test: transformers validates configs in its own error types."""
    import shutil

    from moe_triton.models import load_model

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_checkpoint}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot be read by transformers") as error:
        load_model(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("drop,match", [
    ("m.experts.1.up_proj.weight", r"missing tensor m\.experts\.1\.up_proj\.weight"),
    ("m.experts.1.down_proj.weight", r"missing tensor m\.experts\.1\.down_proj\.weight"),
])
def test_the_last_expert_missing_from_one_projection_is_named(drop, match):
    """Found by the fuzz test: a projection lacking only its last expert stacked fewer experts."""
    from moe_triton.models.checkpoint import fuse_per_expert

    tensors = {f"m.experts.{e}.{proj}.weight": torch.zeros(4, 8) for e in range(2)
               for proj in ("gate_proj", "up_proj", "down_proj")}
    del tensors[drop]
    with pytest.raises(ValueError, match=match):
        fuse_per_expert(tensors)
