"""models/fp8.py and the families on FP8 checkpoints: tiny checkpoints in the published layouts, loaded
with their experts kept FP8, against references computed without moe_triton.

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
- Ours in float32 on the torch reference dequantizes the same e4m3 values with the same scales, so it
  must match in float32 (assert_close's float32 tolerance): this checks every scale landed where it
  belongs. Ours on the FP8 kernels (float16 under the interpreter) also quantizes activations: the
  layer input per token per block-width group and the intermediate per row and 32 columns, each
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
    MINIMAX_M2_FP8,
    assert_close,
    per_expert_fp8_layout,
    prompt,
    randomize_,
    relative_error,
    save_checkpoint,
    transformers_fp8_checkpoint,
)
from safetensors.torch import load_file

from moe_triton import FusedMoE, WeightFormat
from moe_triton.models import load_model
from moe_triton.weights import FP8_DTYPE

LOGITS_TOL = 0.05
MARGIN_FACTOR = 4


def qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, decoder_sparse_step=1) | overrides
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def minimax_m2():
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    # MiniMax-M2's 128 x 128 blocks: every linear a multiple of 128 (transformers quantizes only those)
    config = MiniMaxM2Config(vocab_size=97, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                             num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.5})
    return MiniMaxM2ForCausalLM(config)


def cohere2_moe():
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    config = Cohere2MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                              num_experts_per_tok=2, num_shared_experts=1, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], logit_scale=0.5)
    return Cohere2MoeForCausalLM(config)


def minimax_hub_names(state: dict) -> dict:
    """MiniMax-M2's published names: block_sparse_moe.experts.N.w1 / w3 / w2 (.weight, .weight_scale_inv)."""
    renamed = {}
    for name, t in state.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        name = re.sub(r"\.experts\.(\d+)\.(gate|up|down)_proj\.",
                      lambda m: f".experts.{m[1]}.{dict(gate='w1', up='w3', down='w2')[m[2]]}.", name)
        renamed[name] = t
    return renamed


# family -> (tiny model, seed, FP8 block, modules_to_not_convert, published layout from transformers' one);
# seeds chosen for top-2 margins of at least 5x the FP8 logit error and a non-degenerate generation
FAMILIES = {
    "qwen3_moe": (qwen3_moe, 1, (32, 32), None, per_expert_fp8_layout),
    "minimax_m2": (minimax_m2, 12, (128, 128), MINIMAX_M2_FP8["modules_to_not_convert"],
                   lambda s: minimax_hub_names(per_expert_fp8_layout(s))),
    "cohere2_moe": (cohere2_moe, 7, (32, 32), None, per_expert_fp8_layout),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def fp8_checkpoint(request, tmp_path_factory):
    """(family, {layout: directory}) of one tiny random model quantized by transformers."""
    make, seed, block, keep, published = FAMILIES[request.param]
    torch.manual_seed(0)
    model = randomize_(make().eval(), seed=seed)
    root = tmp_path_factory.mktemp(f"{request.param}-fp8")
    written, fused = transformers_fp8_checkpoint(model, root / "transformers", block, keep)
    state = load_file(written / "model.safetensors")
    layouts = {"transformers": written, "published": save_checkpoint(published(state), written, root / "published"),
               "sharded": save_checkpoint(published(state), written, root / "sharded", shards=3),
               "fused": save_checkpoint(fused, written, root / "fused")}
    return request.param, layouts


def dequantized_reference(path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                dtype=torch.float32).eval()


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_the_checkpoint_is_what_it_says(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    config = json.loads((layouts["published"] / "config.json").read_text())["quantization_config"]
    state = load_file(layouts["published"] / "model.safetensors")
    expert = next(k for k in state if re.search(r"experts\.0\.(gate_proj|w1)\.weight$", k))
    assert config["quant_method"] == "fp8" and state[expert].dtype == FP8_DTYPE
    assert expert.replace(".weight", ".weight_scale_inv") in state
    if family == "minimax_m2":  # the router, its bias and the head stay unquantized, as MiniMax-M2's do
        assert config["modules_to_not_convert"] == ["gate", "e_score_correction_bias", "lm_head"]
        assert state["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
        assert state["lm_head.weight"].dtype == torch.float32 and "lm_head.weight_scale_inv" not in state
        assert state["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE  # attention is FP8


def test_every_layout_loads_the_same_fp8_experts(fp8_checkpoint):
    family, layouts = fp8_checkpoint
    models = {name: load_model(path, dtype=torch.float32) for name, path in layouts.items()}
    block = FAMILIES[family][2]
    reference = models.pop("published")
    for layer in moe_layers(reference):
        assert layer.weight_format == WeightFormat.fp8_block(*block) and layer.gate_up_proj.dtype == FP8_DTYPE
    for name, model in models.items():
        for (key, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(reference.state_dict().items())):
            same = a.view(torch.uint8).equal(b.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, b)
            assert same, f"{name}: {key}"


def test_float32_logits_equal_transformers_on_the_dequantized_checkpoint(fp8_checkpoint):
    """Ours dequantizes the experts in the torch reference and the other FP8 linears at load: the same
    float32 weights transformers' dequantize=True builds, so float32 tolerance."""
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
    ours = load_model(layouts["published"], dtype=torch.float16, backend="triton")  # FP8 GEMMs, interpreted
    reference = dequantized_reference(layouts["published"])
    ids = prompt()
    ours.setup(2, 32)
    with torch.no_grad():
        logits, expected = ours.prefill(ids), reference(ids).logits
    assert relative_error(logits, expected) < LOGITS_TOL
    worst = (logits - expected).abs().max().item()
    generated = reference.generate(ids, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        steps = reference(generated).logits[:, ids.shape[1] - 1:-1]  # the logits each new token was picked from
    top2 = steps.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin > MARGIN_FACTOR * worst, f"top-2 margin {margin:.3g} vs FP8 logit error {worst:.3g}: pick another seed"
    assert len(set(generated[:, ids.shape[1]:].flatten().tolist())) > 2, "degenerate generation: pick another seed"
    assert torch.equal(ours.generate(ids, max_new_tokens=8), generated)
