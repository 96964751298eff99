"""models/: each family's logits and greedy tokens equal transformers' for the same tiny random
checkpoint (written by save_pretrained, loaded back by our loader), in float32 on the CPU."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from helpers import FAMILIES, assert_close, prompt, randomize_
from moe_triton.models import load_model


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    make, seed = FAMILIES[request.param]
    reference = randomize_(make().eval(), seed=seed)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)  # the Hub layout: per-expert tensors
    return reference, path


def test_logits_match_transformers(checkpoint):
    reference, path = checkpoint
    ours = load_model(path, dtype=torch.float32)
    ids = prompt()
    ours.setup(max_batch=2, max_seq=32)
    with torch.no_grad():
        expected = reference(ids).logits
    assert_close(ours.prefill(ids), expected, torch.float32, scale=5)


def test_greedy_generation_matches_transformers(checkpoint):
    reference, path = checkpoint
    ours = load_model(path, dtype=torch.float32)
    ids = prompt()
    expected = reference.generate(ids, max_new_tokens=16, do_sample=False)
    actual = ours.generate(ids, max_new_tokens=16)
    assert len(set(expected[:, 7:].flatten().tolist())) > 2, "degenerate reference generation: pick another seed"
    assert torch.equal(actual, expected)


def test_fused_and_sharded_layouts_load(checkpoint, tmp_path):
    reference, path = checkpoint
    state = {k: v.clone() for k, v in reference.state_dict().items()}  # transformers 5 fused experts; untied copies
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused = load_model(tmp_path, dtype=torch.float32)
    per_expert = load_model(path, dtype=torch.float32)
    for (name, a), (_, b) in zip(sorted(fused.state_dict().items()), sorted(per_expert.state_dict().items())):
        assert torch.equal(a, b), name


def break_checkpoint(path, tmp_path, edit):
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop("model.norm.weight"), "missing tensor in checkpoint: model.norm.weight"),
    (lambda s: s.update({"model.extra.weight": torch.zeros(2)}), "unexpected tensor in checkpoint: model.extra.weight"),
    (lambda s: s.update({"model.norm.weight": torch.zeros(3)}), "model.norm.weight has shape"),
    (lambda s: s.pop(next(k for k in sorted(s) if re.search(r"layers\.0\..*experts\.1\.(up_proj|w3)\.weight", k))),
     "gate_proj weights without up_proj|missing"),
])
def test_bad_checkpoints_are_rejected_naming_the_tensor(checkpoint, tmp_path, edit, match):
    _, path = checkpoint
    with pytest.raises(ValueError, match=match):
        load_model(break_checkpoint(path, tmp_path, edit))


def test_unsupported_architecture_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tmp_path)


# ---- standalone MoE blocks: MiniMax-M3 and NemotronH ------------------------------------------

def m3_block():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    from moe_triton.models.minimax_m3 import MiniMaxM3MoeBlock

    config = MiniMaxM3VLTextConfig(hidden_size=48, intermediate_size=40, shared_intermediate_size=24,
                                   num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0,
                                   swiglu_limit=0.7, swiglu_alpha=1.702)
    return MiniMaxM3VLSparseMoeBlock(config), MiniMaxM3MoeBlock(config)


def nemotron_block(latent):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    from moe_triton.models.nemotron_h import NemotronHMoeBlock

    config = NemotronHConfig(hidden_size=48, moe_intermediate_size=40, moe_shared_expert_intermediate_size=24,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, moe_latent_size=latent)
    return NemotronHMoE(config), NemotronHMoeBlock(config)


BLOCKS = {"minimax_m3": m3_block, "nemotron_h": lambda: nemotron_block(None),
          "nemotron_h-latent": lambda: nemotron_block(32)}


def per_expert_layout(state):
    """The Hub's per-expert names from transformers' fused tensors."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith(("experts.up_proj", "experts.down_proj")):
            proj = name.rsplit(".", 1)[1]
            for e in range(t.shape[0]):
                out[name.replace(proj, f"{e}.{proj}.weight")] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_moe_block_matches_transformers(name, layout):
    from moe_triton.models.checkpoint import load_into

    reference, ours = BLOCKS[name]()
    randomize_(reference.eval(), seed=7)
    state = reference.state_dict()
    load_into(ours, per_expert_layout(state) if layout == "per_expert" else state, ours.renames)
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert_close(ours(x), reference(x), torch.float32, scale=5)
