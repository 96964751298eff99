"""models/fp8.py and the families on FP8 checkpoints: tiny checkpoints in the published layouts,
loaded with their experts kept FP8, against references computed without moe_triton.

Checkpoints. Block-scaled ones are written by transformers itself: its FineGrainedFP8 quantizer
quantizes a tiny random model on load and save_pretrained writes what it writes (transformers 5.24:
per-expert weights, fused scale grids `experts.gate_up_proj_scale_inv`); `per_expert_fp8_layout`
turns that into the published per-expert layout (Qwen3-*-FP8: experts.N.gate_proj.weight_scale_inv),
MiniMax-M2's names on top. compressed-tensors and ModelOpt layouts are written here from their
published tensor and key names (helpers.fp8_quantize), since no writer for them is installed.

References.
- transformers' own model on the same checkpoint, loaded with FineGrainedFP8Config(dequantize=True)
  (it dequantizes every weight with its scale, offline, on CPU), or for the hand-written layouts
  transformers' model given the dequantized weights (q * scale, helpers.fp8_quantize's definition).
- Ours in float32 on the torch reference dequantizes the same e4m3 values with the same scales, so
  it must match in float32 (assert_close's float32 tolerance): this checks every scale landed where
  it belongs. Ours on the FP8 kernels (float16 under the interpreter) also quantizes activations:
  the layer input per token per block-width group and the intermediate per row and 32 columns, each
  value by at most 2^-4 relative (e4m3: 3 mantissa bits), uniform, RMS 2^-4 / sqrt(3) = 0.036;
  two such roundings give 0.05 relative RMS on the experts' output, and float16 elsewhere adds
  ~1e-3. The logits are a residual stream the experts only add to, so LOGITS_TOL = 0.05 relative
  (in norm) bounds them.
- Greedy tokens are compared only where the reference's top-2 logit margin at every generated step
  exceeds MARGIN_FACTOR times the largest logit difference FP8 made on the prompt, so FP8 error
  cannot flip the argmax; the test asserts that margin before it asserts the tokens.
"""
import json
import re

import pytest
import torch
from helpers import (
    DEEPSEEK_FP8,
    MINIMAX_M2_FP8,
    MODELOPT_FP8,
    assert_close,
    ct_fp8,
    fp8_quantize,
    per_expert_fp8_layout,
    prompt,
    randomize_,
    relative_error,
    rows_that_depend_on_the_batch,
    save_checkpoint,
    sparse_qwen3_moe,
    transformers_fp8_checkpoint,
)
from safetensors.torch import load_file

from moe_triton import FusedMoE, ModelContext, Placement, WeightFormat
from moe_triton.models import default_dtype, load_model
from moe_triton.quant_config import checkpoint_format
from moe_triton.weights import FP8_DTYPE

LOGITS_TOL = 0.05
MARGIN_FACTOR = 4


def minimax_m2():
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    # MiniMax-M2's 128 x 128 blocks: every linear a multiple of 128 (transformers quantizes only
    # those)
    config = MiniMaxM2Config(vocab_size=97, hidden_size=128, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})
    return MiniMaxM2ForCausalLM(config)


def cohere2_moe():
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_experts=8, num_experts_per_tok=2,
                              num_shared_experts=1, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], logit_scale=0.5)
    return Cohere2MoeForCausalLM(config)


def minimax_hub_names(state: dict) -> dict:
    """MiniMax-M2's published names: block_sparse_moe.experts.N.w1 / w3 / w2 (.weight,
    .weight_scale_inv)."""
    renamed = {}
    for name, t in state.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        name = re.sub(r"\.experts\.(\d+)\.(gate|up|down)_proj\.",
                      lambda m: f".experts.{m[1]}.{dict(gate='w1', up='w3', down='w2')[m[2]]}.",
                      name)
        renamed[name] = t
    return renamed


# family -> (tiny model, seed, FP8 block, modules_to_not_convert, published layout from
# transformers' one); seeds chosen for top-2 margins of at least 5x the FP8 logit error and a
# non-degenerate generation
FAMILIES = {
    "qwen3_moe": (sparse_qwen3_moe, 1, (32, 32), None, per_expert_fp8_layout),
    "minimax_m2": (minimax_m2, 12, (128, 128), MINIMAX_M2_FP8["modules_to_not_convert"],
                   lambda s: minimax_hub_names(per_expert_fp8_layout(s))),
    "cohere2_moe": (cohere2_moe, 7, (32, 32), None, per_expert_fp8_layout),
}


def build_fp8_checkpoint(family, root):
    """{layout: directory} of one tiny random model quantized by transformers."""
    make, seed, block, keep, published = FAMILIES[family]
    torch.manual_seed(0)
    model = randomize_(make().eval(), seed=seed)
    written, fused = transformers_fp8_checkpoint(model, root / "transformers", block, keep)
    state = load_file(written / "model.safetensors")
    return {"transformers": written,
            "published": save_checkpoint(published(state), written, root / "published"),
            "sharded": save_checkpoint(published(state), written, root / "sharded", shards=3),
            "fused": save_checkpoint(fused, written, root / "fused")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def fp8_checkpoint(request, tmp_path_factory):
    return request.param, build_fp8_checkpoint(request.param,
                                               tmp_path_factory.mktemp(f"{request.param}-fp8"))


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    return build_fp8_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3-fp8"))


def dequantized_reference(path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_the_checkpoint_is_what_it_says(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    config = json.loads((layouts["published"] / "config.json").read_text())["quantization_config"]
    state = load_file(layouts["published"] / "model.safetensors")
    expert = next(k for k in state if re.search(r"experts\.0\.(gate_proj|w1)\.weight$", k))
    assert config["quant_method"] == "fp8" and state[expert].dtype == FP8_DTYPE
    assert expert.replace(".weight", ".weight_scale_inv") in state
    # the router, its bias and the head stay unquantized, as MiniMax-M2's do
    if family == "minimax_m2":
        assert config["modules_to_not_convert"] == ["gate", "e_score_correction_bias", "lm_head"]
        assert state["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
        assert (state["lm_head.weight"].dtype == torch.float32
                and "lm_head.weight_scale_inv" not in state)
        # attention is FP8
        assert state["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE


def test_every_layout_loads_the_same_fp8_experts(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    models = {name: load_model(path, dtype=torch.float32) for name, path in layouts.items()}
    block = FAMILIES[family][2]
    reference = models.pop("published")
    for layer in moe_layers(reference):
        assert (layer.weight_format == WeightFormat.fp8_block(*block)
                and layer.gate_up_proj.dtype == FP8_DTYPE)
    for name, model in models.items():
        for (key, a), (_, b) in zip(sorted(model.state_dict().items()),
                                    sorted(reference.state_dict().items()), strict=True):
            same = (a.view(torch.uint8).equal(b.view(torch.uint8)) if a.dtype == FP8_DTYPE
                    else torch.equal(a, b))
            assert same, f"{name}: {key}"


def test_float32_logits_equal_transformers_on_the_dequantized_checkpoint(fp8_checkpoint):
    """Ours dequantizes the experts in the torch reference and the other FP8 linears at load: the
    same float32 weights transformers' dequantize=True builds, so float32 tolerance."""
    family, layouts = fp8_checkpoint
    ours = load_model(layouts["published"], dtype=torch.float32)
    assert all(layer.backend == "torch" for layer in moe_layers(ours))
    ids = prompt()
    ours.setup(2, 32)
    with torch.no_grad():
        expected = dequantized_reference(layouts["published"])(ids).logits
    assert_close(ours.prefill(ids), expected, torch.float32, scale=5)


def test_fp8_kernels_match_transformers_logits_and_greedy_tokens(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    # FP8 GEMMs, interpreted
    ours = load_model(layouts["published"], dtype=torch.float16, backend="triton")
    reference = dequantized_reference(layouts["published"])
    ids = prompt()
    ours.setup(2, 32)
    with torch.no_grad():
        logits, expected = ours.prefill(ids), reference(ids).logits
    assert relative_error(logits, expected) < LOGITS_TOL
    worst = (logits - expected).abs().max().item()
    generated = reference.generate(ids, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        # the logits each new token was picked from
        steps = reference(generated).logits[:, ids.shape[1] - 1:-1]
    top2 = steps.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin > MARGIN_FACTOR * worst, (f"top-2 margin {margin:.3g} vs FP8 logit error "
                                            f"{worst:.3g}: pick another seed")
    assert len(set(generated[:, ids.shape[1]:].flatten().tolist())) > 2, (
        "degenerate generation: pick another seed")
    assert torch.equal(ours.generate(ids, max_new_tokens=3), generated)


def test_fp8_experts_record_and_replay_their_routing(qwen3_fp8):
    """The routing tape is the experts' format's business not at all: on FP8 experts a replayed
    routing gives the same tokens and is recorded again as given."""
    ours = load_model(qwen3_fp8["published"], dtype=torch.float16, backend="triton")
    ids, free = prompt(), dict(eos_token_id=None, return_routing=True)
    tokens, routing = ours.generate(ids, 3, **free)
    assert (routing >= 0).all()
    replayed, again = ours.generate(ids, 3, routing=routing, **free)
    assert torch.equal(replayed, tokens) and torch.equal(again, routing)


def test_fp8_experts_prefill_a_prompt_to_the_same_bits_alone_and_in_a_batch(qwen3_fp8):
    """batch_invariant() on FP8 experts (float16 activations, the interpreter's FP8 kernels): a
    prompt's prefill logits alone and among three, bitwise. Prefill only: fp16 decode attention
    falls back to torch on the CPU, which the mode does not cover there. (At this size the default
    mode happens to match too; tests/test_invariance.py shows where it does not.)"""
    from moe_triton import batch_invariant

    ours = load_model(qwen3_fp8["published"], dtype=torch.float16, backend="triton")
    ours.setup(max_batch=3, max_seq=16)
    ids = prompt(batch=3, length=5)
    with batch_invariant():
        assert torch.equal(ours.prefill(ids[1:2])[0], ours.prefill(ids)[1])


@pytest.mark.gpu
def test_fp8_experts_prefill_and_decode_are_batch_invariant_on_the_gpu(fp8_checkpoint):
    """Every family's FP8 checkpoint in bf16 on the H200's FP8 kernels: helpers'
    rows_that_depend_on_the_batch (prefill alone vs among three, decode alone vs beside two)."""
    _, layouts = fp8_checkpoint
    ours = load_model(layouts["published"], dtype=torch.bfloat16, device="cuda")
    ours.setup(max_batch=3, max_seq=16)
    assert rows_that_depend_on_the_batch(ours) == []


@pytest.mark.gpu
def test_fp8_experts_record_and_replay_routing_through_graphs_on_the_gpu(fp8_checkpoint):
    """Every family's FP8 checkpoint in bf16 on the FP8 kernels, decode through graphs: the tape
    records every position, and a replay gives the same tokens and records the same ids."""
    _, layouts = fp8_checkpoint
    ours = load_model(layouts["published"], dtype=torch.bfloat16, device="cuda")
    ids, free = prompt().cuda(), dict(eos_token_id=None, return_routing=True)
    tokens, routing = ours.generate(ids, 6, **free)
    assert ours.graphs is not None and ours.graphs.stats.num_graphs > 0
    assert (routing >= 0).all()
    replayed, again = ours.generate(ids, 6, routing=routing, **free)
    assert torch.equal(replayed, tokens) and torch.equal(again, routing)


# ---- bad FP8 checkpoints: one error naming the tensor and what was expected ----------------------

def edited(layouts, tmp_path, edit, layout="published"):
    source = layouts[layout]
    state = load_file(source / "model.safetensors")
    edit(state)
    return save_checkpoint(state, source, tmp_path / "edited")


def expert_key(state, proj="gate_proj", kind="weight_scale_inv", expert=1):
    return next(k for k in sorted(state) if k.endswith(f"experts.{expert}.{proj}.{kind}"))


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop(expert_key(s)), r"missing tensor .*experts\.1\.gate_proj\.weight_scale_inv"),
    (lambda s: s.update({expert_key(s): torch.ones(3, 3)}),
     r"experts\.1\.gate_proj\.weight_scale_inv has shape \(3, 3\)"
     r".*experts\.0\.gate_proj\.weight_scale_inv has \(1, 2\)"),
    (lambda s: [s.update({k: torch.ones(2, 2)}) for k in list(s)
                if re.search(r"layers\.0\..*gate_proj\.weight_scale_inv", k)],
     r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight_scale_inv is a torch\.float32 "
     r"tensor of shape \(2, 2\); fp8 e4m3, 32x32 block scales.* expect a float scale of shape "
     r"\(1, 2\) for their \(32, 64\) weight"),
    (lambda s: [s.pop(k) for k in list(s)
                if re.search(r"layers\.0\..*experts\.\d+\.up_proj\.weight_scale_inv", k)],
     r"missing tensor model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight_scale_inv: fp8 e4m3, "
     r"32x32 block scales.*shape \(1, 2\)"),
    (lambda s: s.pop("model.layers.0.self_attn.q_proj.weight_scale_inv"),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight is torch\.float8_e4m3fn but "
     r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv is missing"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(3, 2)}),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv has shape \(3, 2\); "
     r"expected one of \[\(1,\), \(64, 1\), \(2, 2\)\]"),
    (lambda s: [s.update({k: v.float()}) for k, v in list(s.items())
                if re.search(r"experts\.\d+\.down_proj\.weight$", k)],
     r"tensor model\.layers\.\d\.mlp\.down_proj is torch\.float32, the model expects "
     r"torch\.float8_e4m3fn"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight":
                         s["model.layers.0.self_attn.q_proj.weight"].float()
                         .to(torch.float8_e5m2)}),
     r"^tensor model\.layers\.0\.self_attn\.q_proj\.weight is torch\.float8_e5m2: FP8 checkpoints "
     r"are read as torch\.float8_e4m3fn weights"),
], ids=["missing-scale", "one-scale-misshapen", "scales-misshapen", "no-up-scales",
        "linear-scale-missing", "linear-scale-misshapen", "bf16-experts", "e5m2-attention"])
def test_bad_fp8_checkpoints_name_the_tensor(qwen3_fp8, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_model(edited(qwen3_fp8, tmp_path, edit))


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop("model.layers.0.block_sparse_moe.experts.1.w3.weight_scale_inv"),
     r"missing tensor model\.layers\.0\.block_sparse_moe\.experts\.1\.w3\.weight_scale_inv$"),
    (lambda s: [s.pop(k) for k in list(s) if re.search(r"layers\.0\..*w3\.weight_scale_inv", k)],
     r"missing tensor model\.layers\.0\.block_sparse_moe\.experts\.0\.w3\.weight_scale_inv: .* "
     r"beside model\.layers\.0\.block_sparse_moe\.experts\.0\.w3\.weight, shape \(1, 1\)"),
], ids=["one-expert", "every-expert"])
def test_errors_name_the_checkpoint_s_own_tensors(tmp_path_factory, tmp_path, edit, match):
    """MiniMax-M2's experts are w1 / w3 / w2 under block_sparse_moe: the loader's messages say
    so."""
    layouts = build_fp8_checkpoint("minimax_m2", tmp_path_factory.mktemp("minimax-fp8"))
    with pytest.raises(ValueError, match=match):
        load_model(edited(layouts, tmp_path, edit))


def test_a_fused_gate_up_grid_that_cannot_be_split_is_refused(tmp_path):
    """I = 48 with 32-row blocks: transformers quantizes the fused [gate; up] (96 rows) in three
    block rows, the middle one holding gate rows 32..47 and up rows 0..15 under one scale."""
    torch.manual_seed(0)
    path, fused = transformers_fp8_checkpoint(
        randomize_(sparse_qwen3_moe(moe_intermediate_size=48).eval(), seed=1),
        tmp_path / "written", (32, 32))
    assert fused["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 3, 2)
    for source in (path, save_checkpoint(fused, path, tmp_path / "fused")):
        with pytest.raises(ValueError,
                           match=r"tensor model\.layers\.0\.mlp\.experts\.gate_up_proj_scale_inv: "
                                 r"one scale grid over the concatenated \[gate; up\] rows, but "
                                 r"I=48 is not a multiple of block_n=32"):
            load_model(source)


def test_fp8_tensors_without_a_quantization_config_are_refused(qwen3_fp8, tmp_path):
    layouts = qwen3_fp8
    config = json.loads((layouts["published"] / "config.json").read_text())
    path = save_checkpoint(load_file(layouts["published"] / "model.safetensors"),
                           layouts["published"], tmp_path / "x")
    config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError,
                       match=r"tensor model\.layers\.\d\.self_attn\.\w_proj\.weight is "
                             r"torch\.float8_e4m3fn but config\.json has no quantization_config"):
        load_model(path, dtype=torch.bfloat16)
    config["quantization_config"] = {**DEEPSEEK_FP8, "weight_block_size": [32, 32],
                                     "activation_scheme": "static"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_scheme='static': expected 'dynamic'"):
        load_model(path)


# ---- compressed-tensors: the three FP8 strategies, written from the published names --------------

# compressed-tensors' names (compressors/quantized_compressors/naive_quantized.py:
# compression_param_names; quantization/lifecycle/initialize.py: "{base}_scale" with base "weight" /
# "input"): every quantized Linear X stores X.weight (e4m3), X.weight_scale and, with static
# activations, X.input_scale. Zero points of symmetric schemes are not saved
# (quantized_compressors/base.py: _skip_zp).
CT_STRATEGIES = {"tensor": ct_fp8("tensor", ignore=["lm_head", "re:.*mlp.gate$"]),
                 "channel": ct_fp8("channel", ignore=["lm_head", "re:.*mlp.gate$"]),
                 "block": ct_fp8("block", block=(32, 32), ignore=["lm_head", "re:.*mlp.gate$"])}


@pytest.fixture(scope="module", params=list(CT_STRATEGIES))
def ct_checkpoint(request, tmp_path_factory):
    """(strategy, compressed-tensors checkpoint, the same weights dequantized as an unquantized
    checkpoint)."""
    torch.manual_seed(0)
    model = randomize_(sparse_qwen3_moe().eval(), seed=1)
    root = tmp_path_factory.mktemp(f"ct-{request.param}")
    model.save_pretrained(root / "unquantized")
    quantized, dequantized = {}, {}
    g = torch.Generator().manual_seed(2)
    for name, w in load_file(root / "unquantized" / "model.safetensors").items():
        module = name.removesuffix(".weight")
        # the router (mlp.gate), norms, embeddings and the head stay
        if not name.endswith("proj.weight"):
            quantized[name] = dequantized[name] = w
            continue
        q, scale = fp8_quantize(w, request.param, (32, 32))
        # scales as bf16 write them
        quantized |= {name: q, f"{module}.weight_scale": scale.to(torch.bfloat16).float()}
        if request.param == "tensor":  # calibrated static input scales, a different one per module
            quantized[f"{module}.input_scale"] = torch.rand(1, generator=g) * 0.01 + 4 / 448
        dequantized[name] = fp8_dequantize(q, quantized[f"{module}.weight_scale"], request.param,
                                           (32, 32))
    config = json.loads((root / "unquantized" / "config.json").read_text())
    path = save_checkpoint(quantized, root / "unquantized", root / "ct")
    (path / "config.json").write_text(
        json.dumps(config | {"quantization_config": CT_STRATEGIES[request.param]}))
    return request.param, path, save_checkpoint(dequantized, root / "unquantized",
                                                root / "dequantized")


def fp8_dequantize(q, scale, strategy, block):
    """compressed-tensors' definition: q * scale, the scale broadcast over its tensor, row or
    block."""
    if strategy == "block":
        bn, bc = block
        scale = (scale.repeat_interleave(bn, 0)[: q.shape[0]]
                 .repeat_interleave(bc, 1)[:, : q.shape[1]])
    return q.float() * scale


def test_compressed_tensors_strategies_load_and_match(ct_checkpoint):
    from transformers import AutoModelForCausalLM

    strategy, path, dequantized = ct_checkpoint
    fmt = {"tensor": WeightFormat.fp8_tensor(static_input=True),
           "channel": WeightFormat.fp8_channel(), "block": WeightFormat.fp8_block(32, 32)}[strategy]
    ours = load_model(path, dtype=torch.float32)
    assert all(layer.weight_format == fmt for layer in moe_layers(ours))
    # gate and up keep their own per-tensor scales; one static input scale, the largest
    if strategy == "tensor":
        layer = moe_layers(ours)[0]
        state = load_file(path / "model.safetensors")
        gate, up = (state[f"model.layers.0.mlp.experts.3.{p}_proj.weight_scale"]
                    for p in ("gate", "up"))
        assert gate != up and torch.equal(layer.gate_up_proj_scale[3],
                                          torch.cat([gate.expand(32), up.expand(32)]))
        inputs = [v for k, v in state.items()
                  if re.search(r"layers\.0\.mlp\.experts\.\d+\.(gate|up)_proj\.input_scale", k)]
        assert layer.input_scale.item() == max(v.item() for v in inputs)
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    ids = prompt()
    ours.setup(2, 32)
    with torch.no_grad():
        expected = reference(ids).logits
    assert_close(ours.prefill(ids), expected, torch.float32, scale=5)
    kernels = load_model(path, dtype=torch.float16, backend="triton")
    kernels.setup(2, 32)
    assert relative_error(kernels.prefill(ids), expected) < LOGITS_TOL


# ---- Cohere2-MoE's rule keeps FP8 off trtllm-gen: FP8 runs on the Triton kernels there and on SM90

@pytest.mark.parametrize("sm", [(10, 0), (9, 0)], ids=["sm100", "sm90"])
def test_cohere2_moe_fp8_runs_on_triton_fp8_on_blackwell_and_hopper(sm):
    from transformers import Cohere2MoeConfig

    from moe_triton.models.cohere2_moe import cohere2_moe_block
    from moe_triton.platform import Platform

    config = Cohere2MoeConfig(hidden_size=128, intermediate_size=128, num_experts=8,
                              num_experts_per_tok=2, num_shared_experts=1)
    context = ModelContext("Cohere2MoeForCausalLM", {**DEEPSEEK_FP8})
    platform = Platform("cuda", sm, "0.7.2.post1")
    # as load_model builds it: shapes only
    with torch.device("meta"), default_dtype(torch.bfloat16):
        layer = cohere2_moe_block(config, Placement(context=context, platform=platform))
    assert layer.weight_format == WeightFormat.fp8_block(128, 128) and layer.backend == "triton"
    assert layer.resolution.rule == "cohere2_moe"
    assert ("rejects this FP8 MoE format" in layer.resolution.reason) == (sm == (10, 0))


# ---- NemotronH's MoE block in ModelOpt per-tensor FP8, I = 7688 / 8 = 961 ------------------------

def nemotron_h(intermediate, experts=4):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    config = NemotronHConfig(hidden_size=32, moe_intermediate_size=intermediate,
                             moe_shared_expert_intermediate_size=24, n_routed_experts=experts,
                             num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    return config, randomize_(NemotronHMoE(config).eval(), seed=4)


def modelopt_layout(block, x):
    """ModelOpt's FP8 export of a NemotronH MoE block (ModelOpt's unified HF checkpoint: names as in
    the original, per-tensor float32 `weight_scale` and static `input_scale` scalars beside each
    quantized Linear's e4m3 `weight`; vLLM's ModelOpt docs: "FP8: per-tensor weight scale (+
    optional static activation scale)"), experts per expert; the router as it is. Input scales are
    calibrated on `x` (max |input| / 448, a little above for the experts, each its own). Returns
    (tensors, the dequantized state for transformers' block)."""
    tensors, dequantized = {}, {}
    g = torch.Generator().manual_seed(5)
    for name, w in block.state_dict().items():
        if name.startswith("gate."):
            tensors[name] = dequantized[name] = w
            continue
        per_expert = name.startswith("experts.")
        weights = w.unbind(0) if per_expert else [w]
        names = ([name.replace("experts.", f"experts.{e}.") for e in range(len(weights))]
                 if per_expert else [name.removesuffix(".weight")])
        parts = []
        for module, weight in zip(names, weights, strict=True):
            q, scale = fp8_quantize(weight, "tensor")
            tensors |= {f"{module}.weight": q, f"{module}.weight_scale": scale.reshape(()),
                        f"{module}.input_scale": (x.abs().max() / 448
                                                  * (1 + 0.1 * torch.rand((), generator=g)))}
            parts.append(q.float() * scale)
        dequantized[name] = torch.stack(parts) if per_expert else parts[0]
    return tensors, dequantized


def nemotron_fp8_block(config, tensors, backend="auto", dtype=torch.float32):
    from moe_triton.models.checkpoint import load_into
    from moe_triton.models.nemotron_h import NemotronHMoeBlock

    with default_dtype(dtype):
        ours = NemotronHMoeBlock(config,
                                 Placement(backend, ModelContext(quant_config=MODELOPT_FP8)))
    load_into(ours, tensors, ours.renames, checkpoint=checkpoint_format(MODELOPT_FP8), dtype=dtype)
    ours.prepare_weights()
    return ours


@pytest.fixture(scope="module")
def nemotron_961():
    config, reference = nemotron_h(961)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(8))
    tensors, dequantized = modelopt_layout(reference, x)
    reference.load_state_dict(dequantized)
    with torch.no_grad():
        expected = reference(x)
    return config, tensors, x, expected


def test_nemotron_h_modelopt_fp8_block_matches_transformers(nemotron_961):
    config, tensors, x, expected = nemotron_961
    ours = nemotron_fp8_block(config, tensors)
    assert (ours.weight_format == WeightFormat.fp8_tensor(static_input=True)
            and ours.gate_up_proj.dtype == FP8_DTYPE)
    inputs = [v for k, v in tensors.items()
              if re.fullmatch(r"experts\.\d+\.up_proj\.input_scale", k)]
    # w13's input scales, the largest; w2's are not used
    assert ours.input_scale.item() == max(inputs).item()
    with torch.no_grad():
        assert_close(ours(x), expected, torch.float32, scale=5)
    # static input scale
    kernels = nemotron_fp8_block(config, tensors, backend="triton", dtype=torch.float16)
    with torch.no_grad():
        assert relative_error(kernels(x.half()), expected) < LOGITS_TOL


def test_nemotron_h_i961_padded_for_a_16_aligned_backend_gives_the_same_output(nemotron_961,
                                                                                 monkeypatch):
    """The field's case: I = 961 on a backend whose kernels need I % 16 == 0 (CUTLASS, which cannot
    run here): a stand-in backend with that multiple pads up_proj and its per-row scales to 976."""
    from dataclasses import replace

    from moe_triton.runners import SPECS

    monkeypatch.setitem(SPECS, "torch_pad16",
                        replace(SPECS["torch"], backend="torch_pad16", intermediate_multiple=16))
    config, tensors, x, expected = nemotron_961
    unpadded, padded = (nemotron_fp8_block(config, tensors, "torch"),
                        nemotron_fp8_block(config, tensors, "torch_pad16"))
    assert unpadded.gate_up_proj.shape == (4, 961, 32) and padded.gate_up_proj.shape == (4, 976, 32)
    assert padded.gate_up_proj_scale.shape == (4, 976) and padded.down_proj.shape == (4, 32, 976)
    assert (not padded.gate_up_proj[:, 961:].view(torch.uint8).any()
            and not padded.down_proj[:, :, 961:].view(torch.uint8).any())
    with torch.no_grad():
        out = padded(x)
        assert_close(out, unpadded(x), torch.float32)
        assert_close(out, expected, torch.float32, scale=5)


def test_nemotron_h_7688_over_8_ranks_is_961_each_and_padded_sums_to_the_whole():
    """moe_intermediate_size 7688 at tensor-parallel 8: each rank's slice (961, per-tensor scales
    cut with their rows) padded to 976, and the eight partial outputs sum to the whole layer's."""
    from moe_triton import fused_experts_torch
    from moe_triton.activation import Activation, ActivationKind
    from moe_triton.parallel import ParallelSpec, shard_expert_weights
    from moe_triton.runners.padding import pad_expert_weights

    config, reference = nemotron_h(7688, experts=2)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(9))
    tensors, _ = modelopt_layout(reference, x)
    whole = nemotron_fp8_block(config, tensors).expert_weights()
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    relu2 = Activation(ActivationKind.RELU2)
    total = torch.zeros(6, 32)
    for rank in range(8):
        shard = pad_expert_weights(shard_expert_weights(whole, ParallelSpec(tp_size=8), rank), 16)
        assert shard.intermediate_size == 976 and shard.w13_scale.shape == (2, 976)
        total += fused_experts_torch(x, *shard.dequantized(), ids, weights, activation=relu2)
    assert_close(total,
                 fused_experts_torch(x, *whole.dequantized(), ids, weights, activation=relu2),
                 torch.float32, scale=2)


# ---- on the GPU (pytest -m gpu) ------------------------------------------------------------------

# bf16 everywhere else adds to FP8's activation error: test_models.py allows 3e-2 for bf16 alone.
GPU_LOGITS_TOL = LOGITS_TOL + 3e-2


@pytest.mark.gpu
def test_fp8_checkpoint_on_the_gpu_matches_transformers_and_decodes_through_graphs(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    ours = load_model(layouts["published"], dtype=torch.bfloat16, device="cuda")
    assert all(layer.backend == "triton" and layer.gate_up_proj.dtype == FP8_DTYPE
               for layer in moe_layers(ours))
    reference = dequantized_reference(layouts["published"]).cuda()
    ids = prompt().cuda()
    ours.setup(2, 32)
    with torch.no_grad():
        assert relative_error(ours.prefill(ids), reference(ids).logits) < GPU_LOGITS_TOL
    graphed = ours.generate(ids, max_new_tokens=8)
    assert ours.graphs is not None and ours.graphs.stats.num_graphs > 0
    ours.use_graphs = False
    ours.setup(2, 32)
    assert torch.equal(ours.generate(ids, max_new_tokens=8), graphed)  # graph replay is bit-stable


@pytest.mark.gpu
@pytest.mark.parametrize("multiple", [1, 16], ids=["I961", "I961-padded-to-976"])
def test_nemotron_h_modelopt_fp8_on_the_gpu_padded_or_not(nemotron_961, monkeypatch, multiple):
    """The ModelOpt per-tensor block on the Triton FP8 kernels in bf16 (static input scale), as
    loaded and padded for a 16-aligned backend (a Triton stand-in with that multiple), against
    transformers."""
    from dataclasses import replace

    from moe_triton.runners import SPECS

    monkeypatch.setitem(SPECS, "triton_pad",
                        replace(SPECS["triton"], backend="triton_pad",
                                intermediate_multiple=multiple))
    config, tensors, x, expected = nemotron_961
    with torch.device("cuda"):
        ours = nemotron_fp8_block(config, tensors, "triton_pad", torch.bfloat16)
    assert (ours.gate_up_proj.shape == (4, 976 if multiple == 16 else 961, 32)
            and ours.gate_up_proj.is_cuda)
    with torch.no_grad():
        assert relative_error(ours(x.cuda().bfloat16()).float().cpu(), expected) < GPU_LOGITS_TOL
