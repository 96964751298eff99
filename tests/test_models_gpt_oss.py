"""models/gpt_oss.py: a tiny random gpt-oss (sinks, a 4-token window shorter than the prompt,
YaRN, biased router and experts, interleaved gate/up) saved as its checkpoints ship, in MXFP4
and in bf16, against transformers' own GptOssForCausalLM on the same files: float32 on CPU
(transformers reads MXFP4 offline there with Mxfp4Config(dequantize=True)); on the GPU, bf16
parity and decode through CUDA graphs equal to eager."""
import json

import pytest
import torch
from helpers import assert_close, gpt_oss_checkpoint, prompt, relative_error
from safetensors.torch import load_file, save_file

from moe_triton.models import load_model
from moe_triton.models.registry import layer_resolutions, plan_model
from moe_triton.weights import WeightFormat

PROMPT_LENGTH = 9  # longer than the window (4): the sliding layers drop the prompt's start


def transformers_model(path, mxfp4: bool, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quantization = dict(quantization_config=Mxfp4Config(dequantize=True)) if mxfp4 else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                **quantization).to(device).eval()


@pytest.fixture(scope="module", params=["mxfp4", "bf16"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    mxfp4 = request.param == "mxfp4"
    gpt_oss_checkpoint(path, mxfp4)
    return transformers_model(path, mxfp4), path, mxfp4


def test_logits_match_transformers_and_the_sinks_are_seen(checkpoint):
    reference, path, mxfp4 = checkpoint
    ours = load_model(path, dtype=torch.float32)
    experts = ours.model.layers[0].mlp
    assert experts.weight_format == (WeightFormat.mxfp4() if mxfp4 else WeightFormat())
    assert experts.gate_up_proj.dtype == (torch.uint8 if mxfp4 else torch.float32)
    ids = prompt(length=PROMPT_LENGTH)
    ours.setup(max_batch=2, max_seq=32)
    with torch.no_grad():
        expected = reference(ids).logits
    assert_close(ours.prefill(ids), expected, torch.float32, scale=5)
    for layer in ours.model.layers:  # the ablation: without its sinks the model is another one
        layer.self_attn.sinks.data.zero_()
    assert relative_error(ours.prefill(ids), expected) > 0.05


def test_a_prefill_in_chunks_equals_transformers(checkpoint, monkeypatch):
    """Chunks of 2 queries: the sliding layers' chunks start past the prompt's first keys, the
    full layers' end before its last ones (what a long prompt skips)."""
    from moe_triton.models import layers

    reference, path, _ = checkpoint
    monkeypatch.setattr(layers, "PREFILL_CHUNK", 2)
    ours = load_model(path, dtype=torch.float32, backend="torch")
    ids = prompt(length=PROMPT_LENGTH)
    ours.setup(max_batch=2, max_seq=32)
    with torch.no_grad():
        expected = reference(ids).logits
    assert_close(ours.prefill(ids), expected, torch.float32, scale=5)


def test_greedy_generation_matches_transformers(checkpoint):
    reference, path, _ = checkpoint
    ours = load_model(path, dtype=torch.float32)
    ids = prompt(length=PROMPT_LENGTH)
    # decode steps past the window: the sliding layers' cache reads move with the position
    expected = reference.generate(ids, max_new_tokens=5, do_sample=False)
    assert len(set(expected[:, PROMPT_LENGTH:].flatten().tolist())) > 2, (
        "degenerate reference generation: pick another seed")
    assert torch.equal(ours.generate(ids, max_new_tokens=5), expected)


def test_resolve_reports_mxfp4_experts(tmp_path):
    gpt_oss_checkpoint(tmp_path, mxfp4=True)
    plan = plan_model(tmp_path)
    assert plan.checkpoint.experts == WeightFormat.mxfp4()
    resolutions = layer_resolutions(plan)
    assert len(resolutions) == 3 and {r.backend for r in resolutions} == {"torch"}  # CPU


def edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.self_attn.sinks"),
     r"missing tensor in checkpoint: model\.layers\.1\.self_attn\.sinks"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales":
                         t["model.layers.0.mlp.experts.down_proj_scales"][:, :, :0]}),
     r"tensor model\.layers\.0\.mlp\.experts\.down_proj_scales is a torch\.uint8 tensor of shape "
     r"\(8, 64, 0\); .* gives a uint8 tensor of shape \(8, 64, 1\)"),
    (lambda t: t.pop("model.layers.2.mlp.experts.gate_up_proj_bias"),
     r"missing tensor model\.layers\.2\.mlp\.experts\.gate_up_proj_bias"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks":
                         t["model.layers.0.mlp.experts.gate_up_proj_blocks"].float()}),
     r"gate_up_proj_blocks is a torch\.float32 tensor .* gives a uint8 tensor"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, edit, match):
    gpt_oss_checkpoint(tmp_path, mxfp4=True)
    edit_tensors(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


@pytest.mark.parametrize("layer_types,match", [
    (["sliding_attention", "full_attention"], "layer_types"),  # 3 layers: transformers refuses
    (["sliding_attention", "chunked_attention", "full_attention"], "layer_types"),  # we do
])
def test_layer_types_that_disagree_with_the_model_are_refused(tmp_path, layer_types, match):
    gpt_oss_checkpoint(tmp_path, mxfp4=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"layer_types": layer_types}))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


@pytest.mark.gpu
def test_bf16_logits_and_graph_decode_match_transformers_on_the_gpu(checkpoint):
    """bf16 on the H200: MXFP4 experts through the Triton W4A16 kernels, sinks in the decode
    kernel. transformers' bf16 model rounds its attention softmax to bf16, so both bf16 models are
    held to transformers' float32 one: ours may err by at most 1.25x what transformers' bf16
    model errs by. Decode through graphs gives eager decode's tokens."""
    _, path, mxfp4 = checkpoint
    ours = load_model(path, dtype=torch.bfloat16, device="cuda")
    assert {layer.mlp.backend for layer in ours.model.layers} == {"triton"}
    ids = prompt(length=PROMPT_LENGTH).cuda()
    ours.setup(max_batch=2, max_seq=32)
    with torch.no_grad():
        exact = transformers_model(path, mxfp4, torch.float32, "cuda")(ids).logits
        theirs = transformers_model(path, mxfp4, torch.bfloat16, "cuda")(ids).logits.float()
    ours_error, their_error = (relative_error(logits, exact)
                               for logits in (ours.prefill(ids), theirs))
    assert ours_error <= 1.25 * their_error, (ours_error, their_error)
    ours.use_graphs = False
    eager = ours.generate(ids, max_new_tokens=8)
    ours.use_graphs = True
    assert torch.equal(ours.generate(ids, max_new_tokens=8), eager)
    assert ours.graphs is not None
