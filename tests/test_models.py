"""models/: each family's logits and greedy tokens equal transformers' for the same tiny random
checkpoint (written by save_pretrained, loaded back by our loader), in float32 on the CPU; on the
GPU, parity in bf16 and float32, generation through CUDA graphs, overlap on vs off, and a
race-forcing test that proves the inplace-free contract matters."""
import copy
import json
import re
from dataclasses import replace

import pytest
import torch
from helpers import (
    BLOCKS,
    FAMILIES,
    assert_close,
    eos_for_early_stops,
    nemotron_block,
    prompt,
    randomize_,
    randomize_all_,
    relative_error,
)
from safetensors.torch import save_file

import moe_triton
from moe_triton import FusedMoE, Placement, fused_experts
from moe_triton.graphs import run_branches
from moe_triton.models import load_model
from moe_triton.models.causal_lm import FINISHED_CHECK_EVERY
from moe_triton.models.gpt_oss import gpt_oss_moe_spec
from moe_triton.tools.bench import QWEN3_30B_A3B, random_experts, random_inputs


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


def test_prefill_last_is_the_last_position_of_prefill(checkpoint):
    _, path = checkpoint
    # the head over the last position is the model's, not the experts' (the torch backend: a
    # third of the interpreter's time)
    ours = load_model(path, dtype=torch.float32, backend="torch")
    ids = prompt()
    ours.setup(max_batch=2, max_seq=32)
    last = ours.prefill_last(ids)  # the LM head over one position
    assert last.shape == (ids.shape[0], ours.config.vocab_size)
    assert_close(last, ours.prefill(ids)[:, -1], torch.float32)


def test_greedy_generation_matches_transformers(checkpoint, request):
    if request.node.callspec.params["checkpoint"] == "cohere2_moe-sum":
        pytest.skip("the sum strategy's combination is checked by its logits and prefill tests; "
                    "its decode steps are the average variant's code path (half a minute here)")
    reference, path = checkpoint
    # one family decodes through the Triton experts; the others' decode differs from it in the
    # family's attention and blocks, not the experts (the torch backend: a third of the time)
    family = request.node.callspec.params["checkpoint"]
    ours = load_model(path, dtype=torch.float32,
                      **({} if family == "qwen3_moe" else {"backend": "torch"}))
    ids = prompt()
    # 6 tokens: each costs a decode step of both models under the interpreter
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    actual = ours.generate(ids, max_new_tokens=6)
    assert len(set(expected[:, 7:].flatten().tolist())) > 2, (
        "degenerate reference generation: pick another seed")
    assert torch.equal(actual, expected)


def test_generation_stops_at_eos_as_transformers_does(tmp_path):
    """Per-sequence stop, pad after it, and the early return once every row has stopped, against
    transformers' own generate: eos ids passed in, or read from generation_config.json, or turned
    off."""
    from transformers import AutoModelForCausalLM

    # two layers: the cheapest family to decode under the interpreter
    make, seed = FAMILIES["minimax_m2"]
    torch.manual_seed(0)
    reference = randomize_(make().eval(), seed=seed)
    reference.save_pretrained(tmp_path)
    ids, N = prompt(), 12
    L = ids.shape[1]
    # its config's eos lies outside the vocab
    free = reference.generate(ids, max_new_tokens=N, do_sample=False)
    eos, stops = eos_for_early_stops(free, L)
    # both rows stop, early
    assert None not in stops and max(stops) < FINISHED_CHECK_EVERY - 1, (eos, stops)
    pad = next(t for t in range(reference.config.vocab_size - 1, 0, -1)
               if t not in ids and t not in eos)
    # the experts' backend is not what is tested
    ours = load_model(tmp_path, dtype=torch.float32, backend="torch")
    expected = reference.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] == L + max(stops) + 1  # every row stopped: transformers returns early
    assert torch.equal(ours.generate(ids, N, eos_token_id=eos), expected)
    one = dict(eos_token_id=eos[0], pad_token_id=pad)  # an int, and a pad of our own
    assert torch.equal(ours.generate(ids, N, **one),
                       reference.generate(ids, max_new_tokens=N, do_sample=False, **one))
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": eos}))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, dtype=torch.float32, backend="torch")
    assert torch.equal(ours.generate(ids, N),
                       theirs.generate(ids, max_new_tokens=N, do_sample=False))
    assert torch.equal(ours.generate(ids, N, eos_token_id=None), free)  # off
    steps, step = [], ours._decode_step
    ours._decode_step = lambda inputs: steps.append(1) or step(inputs)
    for layer in ours.modules():  # expert-parallel ranks step together: no rank may return early
        if isinstance(layer, FusedMoE):
            layer.runner.lockstep = True
    assert torch.equal(ours.generate(ids, N), expected) and len(steps) == N - 1


def test_fused_and_sharded_layouts_load(checkpoint, tmp_path):
    reference, path = checkpoint
    # transformers 5 fused experts; untied copies
    state = {k: v.clone() for k, v in reference.state_dict().items()}
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
    for (name, a), (_, b) in zip(sorted(fused.state_dict().items()),
                                 sorted(per_expert.state_dict().items()), strict=True):
        assert torch.equal(a, b), name


def write_shards(tmp_path, config_dir, shards: dict, weight_map: dict):
    """shards: file -> {name: tensor}; weight_map as the index should say it, written beside
    config_dir's config."""
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((config_dir / "config.json").read_text())
    return tmp_path


def two_shards(state):
    names = sorted(state)
    return {"a.safetensors": {k: state[k] for k in names[: len(names) // 2]},
            "b.safetensors": {k: state[k] for k in names[len(names) // 2:]}}


def test_a_tensor_in_two_shards_is_read_from_the_one_the_index_names(checkpoint, tmp_path):
    """model.norm.weight lies in both shards, a stale copy in the file read last: the index names
    the first."""
    from safetensors.torch import load_file

    _, path = checkpoint
    state = load_file(path / "model.safetensors")
    name = "model.norm.weight"
    shards = two_shards({k: v for k, v in state.items() if k != name})
    weight_map = {k: file for file, tensors in shards.items()
                  for k in tensors} | {name: "a.safetensors"}
    shards["a.safetensors"][name] = state[name]
    shards["b.safetensors"][name] = torch.full_like(state[name], 7.0)
    ours = load_model(write_shards(tmp_path, path, shards, weight_map), dtype=torch.float32)
    assert torch.equal(ours.model.norm.weight, state[name])


@pytest.mark.parametrize("case,match", [
    ("mapped, not held",
     r"index\.json maps tensor model\.norm\.weight to b\.safetensors, which does not hold it"),
    ("held, not listed",
     r"a\.safetensors holds tensor model\.extra\.weight, which model\.safetensors\.index\.json "
     r"does not list"),
])
def test_an_index_that_disagrees_with_its_shards_is_refused_naming_both(checkpoint, tmp_path, case,
                                                                        match):
    from safetensors.torch import load_file

    _, path = checkpoint
    state = load_file(path / "model.safetensors")
    shards = two_shards({k: v for k, v in state.items() if k != "model.norm.weight"})
    weight_map = {k: file for file, tensors in shards.items() for k in tensors}
    if case == "mapped, not held":
        weight_map["model.norm.weight"] = "b.safetensors"
    else:
        shards["a.safetensors"]["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        load_model(write_shards(tmp_path, path, shards, weight_map))


def test_experts_in_both_layouts_are_refused_naming_both_keys(checkpoint, tmp_path):
    """The per-expert tensors of the Hub layout and transformers 5's fused ones, for the same
    layer."""
    reference, path = checkpoint  # saved in the Hub layout: experts.N.gate_proj.weight, ...
    fused = {k: v.clone() for k, v in reference.state_dict().items()
             if re.search(r"layers\.0\..*experts\.", k)}
    assert fused and all(not re.search(r"experts\.\d", k) for k in fused)
    with pytest.raises(ValueError, match=r"holds these experts twice") as refused:
        load_model(break_checkpoint(path, tmp_path, lambda s: s.update(fused)))
    message = str(refused.value)
    assert re.search(r"fused as model\.layers\.0\.\S*experts\.(gate_up_proj|down_proj)",
                     message), message
    assert re.search(r"per expert as model\.layers\.0\.\S*experts\.\d+\.\w+\.weight",
                     message), message


def break_checkpoint(path, tmp_path, edit):
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop("model.norm.weight"), "missing tensor in checkpoint: model.norm.weight"),
    (lambda s: s.update({"model.extra.weight": torch.zeros(2)}),
     "unexpected tensor in checkpoint: model.extra.weight"),
    (lambda s: s.update({"model.norm.weight": torch.zeros(3)}), "model.norm.weight has shape"),
    # the three are fused into qkv_proj at load
    (lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"),
     r"missing tensor in checkpoint: model\.layers\.1\.self_attn\.k_proj\.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.v_proj.weight": torch.zeros(3, 3)}),
     r"model\.layers\.0\.self_attn\.v_proj\.weight has shape \(3, 3\)"),
    (lambda s: s.pop(next(k for k in sorted(s)
                          if re.search(r"layers\.0\..*experts\.1\.(up_proj|w3)\.weight", k))),
     "gate_proj weights without up_proj|missing"),
])
def test_bad_checkpoints_are_rejected_naming_the_tensor(checkpoint, tmp_path, edit, match):
    _, path = checkpoint
    with pytest.raises(ValueError, match=match):
        load_model(break_checkpoint(path, tmp_path, edit))


def test_unsupported_architecture_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tmp_path)


# ---- standalone MoE blocks: MiniMax-M3 and NemotronH ------------------------------------------

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


# ---- from_transformers: a transformers block as a FusedMoE, from its family's spec ---------------

def qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40,
                                                 num_experts=8, num_experts_per_tok=2,
                                                 norm_topk_prob=norm))


def cohere2_moe(fn, strategy):
    from transformers import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeSparseMoeBlock

    return Cohere2MoeSparseMoeBlock(Cohere2MoeConfig(hidden_size=48, intermediate_size=40,
                                                     num_experts=8, num_experts_per_tok=2,
                                                     expert_selection_fn=fn, num_shared_experts=1,
                                                     norm_topk_prob=True,
                                                     shared_expert_combination_strategy=strategy))


def minimax_m2():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    return MiniMaxM2SparseMoeBlock(MiniMaxM2Config(hidden_size=48, intermediate_size=40,
                                                   num_local_experts=8, num_experts_per_tok=2))


def minimax_m3():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    config = MiniMaxM3VLTextConfig(hidden_size=48, intermediate_size=40,
                                   shared_intermediate_size=24, num_local_experts=8,
                                   num_experts_per_tok=2, routed_scaling_factor=2.5,
                                   swiglu_limit=0.7, swiglu_alpha=1.702)
    return MiniMaxM3VLSparseMoeBlock(config)


def nemotron_h(latent):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    config = NemotronHConfig(hidden_size=48, moe_intermediate_size=40,
                             moe_shared_expert_intermediate_size=24, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, moe_latent_size=latent)
    return NemotronHMoE(config)


TRANSFORMERS_BLOCKS = {
    "qwen3_moe-norm": lambda: qwen3_moe(True),
    "qwen3_moe": lambda: qwen3_moe(False),
    "cohere2_moe-softmax-sum": lambda: cohere2_moe("softmax", "sum"),
    "cohere2_moe-sigmoid-average": lambda: cohere2_moe("sigmoid", "average"),
    "minimax_m2": minimax_m2,
    "minimax_m3": minimax_m3,
    "nemotron_h": lambda: nemotron_h(None),
    "nemotron_h-latent": lambda: nemotron_h(32),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(TRANSFORMERS_BLOCKS))
def test_from_transformers(name, backend):
    block = randomize_all_(TRANSFORMERS_BLOCKS[name]().eval(), seed=len(name))
    layer = moe_triton.from_transformers(block, backend=backend)
    # shared, not copied
    assert layer.gate_up_proj.data_ptr() == (block.experts.gate_up_proj
                                             if hasattr(block.experts, "gate_up_proj")
                                             else block.experts.up_proj).data_ptr()
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        expected, actual = block(x), layer(x)
    assert_close(actual, expected, torch.float32, scale=5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_from_transformers_on_gpt_oss_s_biased_interleaved_block(backend):
    """GptOssMLP: a biased router (top-k on the logits, softmax over the k), biased experts with
    the clamped swiglu, interleaved gate/up rows in transposed storage (copied once into [gate;
    up]); the rest shared. It returns (hidden, router scores): the hidden states compare."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=48, intermediate_size=64, num_local_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=131072)
    block = randomize_all_(GptOssMLP(config).eval(), seed=5)
    layer = moe_triton.from_transformers(block, backend=backend)
    assert layer.gate_bias.data_ptr() == block.router.bias.data_ptr()
    assert layer.down_proj_bias.data_ptr() == block.experts.down_proj_bias.data_ptr()
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        expected, actual = block(x)[0], layer(x)
        unbiased = FusedMoE.from_spec(replace(gpt_oss_moe_spec(config), expert_bias=False),
                                      Placement("torch"))
        unbiased.load_state_dict({k: v for k, v in layer.state_dict().items()
                                  if not k.endswith("proj_bias")}, strict=False)
    assert (unbiased(x) - expected).abs().max() > 0.1 * expected.abs().max()  # biases matter
    assert_close(actual, expected, torch.float32, scale=5)


def test_from_transformers_rejects_unknown_block():
    with pytest.raises(ValueError, match="from_transformers does not know"):
        moe_triton.from_transformers(torch.nn.Linear(2, 2))


def layer_traits(layer: FusedMoE) -> tuple:
    """What a family's spec decides of its layer."""
    return (layer.routing, layer.activation, layer.shared_combination, layer.shared_experts is None,
            layer.expert_input_proj is None, layer.e_score_correction_bias is None,
            *(tuple(t.shape) for t in (layer.gate_weight, layer.gate_up_proj, layer.down_proj)))


@pytest.mark.parametrize("family", ["qwen3_moe", "cohere2_moe", "minimax_m2", "minimax_m3",
                                    "nemotron_h-latent"])
def test_from_transformers_and_the_loader_build_the_same_layer(family):
    """One spec per family: the layer from_transformers makes of transformers' block is the one our
    model (load_model's) or block builds from the same config."""
    from moe_triton.models import MODELS

    if family in FAMILIES:
        theirs = FAMILIES[family][0]()
        with torch.device("meta"):
            ours = MODELS[type(theirs).__name__](theirs.config, Placement("torch"))
        pairs = [(t.mlp, o.mlp) for t, o in zip(theirs.model.layers, ours.model.layers, strict=True)
                 if isinstance(o.mlp, FusedMoE)]
    else:
        pairs = [BLOCKS[family]()]
    assert pairs
    for block, layer in pairs:
        converted = moe_triton.from_transformers(block, backend="torch")
        assert layer_traits(converted) == layer_traits(layer)


def test_from_transformers_refuses_a_block_that_departs_from_its_config():
    from transformers.activations import GELUActivation

    block = qwen3_moe(True)
    block.experts.act_fn = GELUActivation()
    with pytest.raises(ValueError, match=r"Qwen3MoeSparseMoeBlock: its experts apply "
                                         r".*GELU_AND_MUL.* but its config gives .*SILU_AND_MUL"):
        moe_triton.from_transformers(block)
    block = qwen3_moe(True)
    block.gate.weight = torch.nn.Parameter(torch.zeros(6, 48))
    with pytest.raises(ValueError, match=r"gate_weight has shape \(6, 48\) but its config gives "
                                         r"\(8, 48\)"):
        moe_triton.from_transformers(block)


def spec_layer(make):
    """transformers' block, and a plain FusedMoE from its family's spec."""
    from moe_triton.models.registry import BLOCKS as REGISTERED

    block = make()
    return block, FusedMoE.from_spec(REGISTERED[type(block).__name__].spec(block.experts.config))


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "nemotron_h-latent"])
def test_the_loader_renames_a_blocks_tensors_under_the_layers_name(name):
    """FusedMoE's own checkpoint renames (NemotronH's block: + up-only experts, latent projections)
    apply under wherever the layer sits in the model; the model declares none of its own."""
    from moe_triton.models.checkpoint import load_into

    if name.startswith("nemotron_h"):
        reference, ours = nemotron_block(32)
    else:
        reference, ours = spec_layer(TRANSFORMERS_BLOCKS[name])
    randomize_(reference.eval(), seed=7)
    layer = torch.nn.ModuleDict({"mlp": ours})
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})  # ours: layers.0.mlp
    load_into(model, {f"layers.0.mlp.{k}": v for k, v in reference.state_dict().items()}, ())
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert_close(ours(x), reference(x), torch.float32, scale=5)


# ---- on the GPU (pytest -m gpu) ------------------------------------------------------------------

@pytest.mark.gpu
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


@pytest.mark.gpu
def test_prefill_of_a_host_prompt_never_syncs_the_host(checkpoint):
    """A prompt handed over on the CPU, as a tokenizer returns it, is range-checked there: the
    whole prefill then queues its kernels without a host sync (torch's sync debug mode); the same
    prompt on the device (checked with one sync) gives the same logits."""
    from helpers import no_host_sync

    _, path = checkpoint
    ours = load_model(path, dtype=torch.bfloat16, device="cuda")
    ours.setup(2, 32)
    ids = prompt()
    expected = ours.prefill(ids.cuda())
    ours.prefill_last(ids)
    with no_host_sync():
        logits = ours.prefill(ids)
        last = ours.prefill_last(ids)
    assert torch.equal(logits, expected)
    assert relative_error(last, expected[:, -1]) < 1e-2  # the head over one row, not seven


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_graphs_record_and_replay_routing_as_eager_decode_does(checkpoint, dtype):
    """The routing tape inside captured decode steps: the same ids as eager steps record, and a
    replay through the graphs gives the same tokens."""
    _, path = checkpoint
    graphs = load_model(path, dtype=dtype, device="cuda")
    eager = load_model(path, dtype=dtype, device="cuda")
    eager.use_graphs = False
    ids, free = prompt().cuda(), dict(eos_token_id=None, return_routing=True)
    tokens, routing = graphs.generate(ids, 6, **free)
    assert graphs.graphs is not None and graphs.graphs.stats.num_graphs > 0
    expected_tokens, expected = eager.generate(ids, 6, **free)
    assert torch.equal(tokens, expected_tokens) and torch.equal(routing, expected)
    replayed, again = graphs.generate(ids, 6, routing=routing, **free)
    assert torch.equal(replayed, tokens) and torch.equal(again, routing)


@pytest.mark.gpu
def test_float32_generation_through_graphs_matches_transformers(checkpoint):
    reference, path = checkpoint
    reference = copy.deepcopy(reference).to("cuda")
    ours = load_model(path, dtype=torch.float32, device="cuda")
    ids = prompt().cuda()
    # 10 tokens: each costs a decode step of both models under the interpreter
    expected = reference.generate(ids, max_new_tokens=10, do_sample=False)
    actual = ours.generate(ids, max_new_tokens=10)
    assert ours.graphs is not None and ours.graphs.stats.num_graphs > 0  # decode ran through graphs
    assert torch.equal(actual, expected)


@pytest.mark.gpu
def test_decode_past_the_cache_through_graphs_is_refused_and_writes_nothing(checkpoint):
    """decode_step and the graph runner refuse positions and slots outside setup()'s cache before
    any copy; the captured step replayed unchecked (graphs.run) with them writes nothing and faults
    nowhere; generation afterwards still equals transformers'."""
    reference, path = checkpoint
    model = load_model(path, dtype=torch.float32, device="cuda")
    ids = prompt().cuda()
    model.setup(2, 12, batch_sizes=(2,))
    assert model.graphs is not None and model.graphs.stats.num_graphs == 1
    model.prefill(ids)

    def inputs(positions=(7, 7), slots=(0, 1)):
        return {"token_ids": ids[:, -1], "positions": torch.tensor(positions, device="cuda"),
                "slots": torch.tensor(slots, device="cuda")}

    before = [t.clone() for t in model.cache.keys + model.cache.values]
    static = {name: t.clone() for name, t in model.graphs.static.items()}
    for bad in (inputs(positions=(12, 7)), inputs(positions=(7, 2**40)), inputs(slots=(0, -1)),
                inputs(slots=(0, 2))):  # 2: the dummy slot, for the runner's padding rows only
        with pytest.raises(ValueError, match="must lie in"):
            model.decode_step(bad)
        with pytest.raises(ValueError, match="must lie in"):
            model.graphs(bad)
        # nothing copied in
        assert all(torch.equal(model.graphs.static[n], t) for n, t in static.items())
    # inside the graph: the kernels mask
    for unchecked in (inputs(positions=(12, 2**40)), inputs(slots=(-1, 5))):
        logits = model.graphs.run(unchecked)
        torch.cuda.synchronize()
        assert logits.isnan().all()  # attention read nothing
    # wrote nothing
    assert all(torch.equal(a, b)
               for a, b in zip(model.cache.keys + model.cache.values, before, strict=True))
    expected = copy.deepcopy(reference).to("cuda").generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, 5), expected)


@pytest.mark.gpu
def test_eos_stopping_through_graphs_equals_eager_and_transformers():
    make, seed = FAMILIES["minimax_m2"]
    torch.manual_seed(0)
    reference = randomize_(make().eval(), seed=seed)
    ids, N = prompt(), 12
    eos, stops = eos_for_early_stops(reference.generate(ids, max_new_tokens=N, do_sample=False),
                                     ids.shape[1])
    expected = reference.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=eos)
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        reference.save_pretrained(path)
        model = load_model(path, dtype=torch.float32, device="cuda")
    tokens = {}
    for graphs in (True, False):
        model.use_graphs = graphs
        model.setup(2, ids.shape[1] + N)
        assert (model.graphs is not None) == graphs
        tokens[graphs] = model.generate(ids.cuda(), N, eos_token_id=eos).cpu()
    assert torch.equal(tokens[True], tokens[False]) and torch.equal(tokens[True], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("family", [f for f in FAMILIES
                                    if f.startswith("cohere2_moe")])  # the overlapping family
def test_overlap_on_and_off_give_the_same_tokens(family, tmp_path, monkeypatch):
    import moe_triton.layer as layer
    import moe_triton.models.cohere2_moe as cohere

    make, seed = FAMILIES[family]
    torch.manual_seed(0)
    randomize_(make().eval(), seed=seed).save_pretrained(tmp_path)
    path = tmp_path

    calls = []
    spy = lambda *a, **k: calls.append(k.get("role", "alt")) or run_branches(*a, **k)  # noqa: E731
    monkeypatch.setattr(cohere, "run_branches", spy)  # attention || MLP
    monkeypatch.setattr(layer, "run_branches", spy)  # shared || routed (FusedMoE.forward)
    tokens = {}
    for overlap in (False, True):
        model = load_model(path, dtype=torch.bfloat16, device="cuda")
        model.use_overlap = overlap
        calls.clear()
        tokens[overlap] = model.generate(prompt().cuda(), max_new_tokens=16)
        assert bool(calls) == overlap  # the overlapped path was captured only when asked for
    assert {"alt", "alt_mlp"} <= set(calls)
    assert torch.equal(tokens[True], tokens[False])


@pytest.mark.gpu
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

    # compile first: a JIT pause would let the reader finish before the write
    fused_experts(x, w13, w2, ids, weights)
    torch.cuda.synchronize()
    _, side = run_branches(writer, held_back_reader, role="alt")
    torch.cuda.synchronize()
    if inplace:
        assert not torch.equal(side, expected_side), (
            "the in-place write did not race: the test cannot fail")
    else:
        assert torch.equal(side, expected_side)


# ---- routing capture and replay: generate's return_routing / routing --------------------------

@pytest.fixture
def tape_checkpoint(checkpoint, request):
    """`checkpoint` for the routing tape's tests, but for cohere2_moe-sum: its routing and decode
    steps are the average variant's code path (a minute here)."""
    if request.node.callspec.params["checkpoint"] == "cohere2_moe-sum":
        pytest.skip("the same routing and decode code path as cohere2_moe")
    return checkpoint


def transformers_routing(reference, tokens: torch.Tensor) -> torch.Tensor:
    """The experts transformers' own routers pick for `tokens` (B, P), teacher-forced: int32
    [sparse layers, B, P, K] (each router returns logits, weights and the (T, K) ids)."""
    seen = []
    hooks = [module.register_forward_hook(lambda module, args, out: seen.append(out[2]))
             for module in reference.modules() if type(module).__name__.endswith("Router")]
    try:
        with torch.no_grad():
            reference(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    B, P = tokens.shape
    return torch.stack([ids.view(B, P, -1) for ids in seen]).int()


def test_generate_records_the_experts_transformers_routes_to(tape_checkpoint):
    """return_routing: every position through the model (the prompt, each new token but the
    last), each sparse layer's experts in the router's order: those transformers' routers pick
    for the same sequence."""
    reference, path = tape_checkpoint
    # the torch backend: the tape does not depend on the experts' (FP8's test runs ours)
    ours = load_model(path, dtype=torch.float32, backend="torch")
    ids, N = prompt(), 4
    tokens, routing = ours.generate(ids, N, eos_token_id=None, return_routing=True)
    top_k = reference.config.num_experts_per_tok
    assert routing.dtype == torch.int32 and routing.device.type == "cpu"
    assert routing.shape == (len(ours.sparse_layers()), 2, ids.shape[1] + N - 1, top_k)
    assert torch.equal(routing, transformers_routing(reference, tokens[:, :-1]))


def test_replayed_routing_gives_the_same_tokens_even_after_the_router_changes(tape_checkpoint):
    _, path = tape_checkpoint
    ours = load_model(path, dtype=torch.float32, backend="torch")
    ids, free = prompt(), dict(eos_token_id=None, return_routing=True)
    tokens, routing = ours.generate(ids, 2, **free)
    replayed, again = ours.generate(ids, 2, routing=routing, **free)
    assert torch.equal(replayed, tokens) and torch.equal(again, routing)  # captured while replayed
    with torch.no_grad():  # another router: free routing changes
        for layer in ours.sparse_layers():
            layer.gate_weight.copy_(torch.randn(layer.gate_weight.shape,
                                                generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(ours.generate(ids, 2, **free)[1], routing)
    assert torch.equal(ours.generate(ids, 2, routing=routing, **free)[1], routing)


def test_recorded_routing_ends_at_each_sequence_s_last_token_and_replays_with_eos(tape_checkpoint,
                                                                                 request):
    """With eos stopping, a row's positions from its last generated token on hold -1; replayed
    (those positions route freely), the same tokens come out. One family: where a sequence ends
    is generate's, not the family's."""
    if request.node.callspec.params["checkpoint"] != "qwen3_moe":
        pytest.skip("one family: the stop bookkeeping is the same for every one")
    _, path = tape_checkpoint
    ours = load_model(path, dtype=torch.float32, backend="torch")
    ids, N = prompt(length=5), 6  # (7 tokens: both rows of the Qwen3 model continue alike)
    L = ids.shape[1]
    eos, stops = eos_for_early_stops(ours.generate(ids, N, eos_token_id=None), L)
    tokens, routing = ours.generate(ids, N, eos_token_id=eos, return_routing=True)
    assert routing.shape[2] == L + N - 1
    for row, stop in enumerate(stops):
        end = L + (N - 1 if stop is None else stop)  # the positions its tokens went through
        assert (routing[:, row, :end] >= 0).all() and (routing[:, row, end:] == -1).all()
    assert torch.equal(ours.generate(ids, N, eos_token_id=eos, routing=routing), tokens)


def test_bad_routing_is_refused_naming_it_before_anything_runs(tape_checkpoint, no_launch):
    _, path = tape_checkpoint
    ours = load_model(path, dtype=torch.float32)
    ids = prompt()
    layers, top_k = len(ours.sparse_layers()), ours.sparse_layers()[0].routing.top_k
    good = torch.zeros(layers, 2, ids.shape[1] + 2, top_k, dtype=torch.int32)
    num_experts = len(ours.sparse_layers()[0].gate_weight)
    half_free = good.clone()
    half_free[0, 1, 3, 0] = -1
    for bad, match in ((good[:, :1], "shape"), (good.float(), "int32/int64"),
                       (good + num_experts, r"\[0, \d+\)"), (half_free, "all be -1"),
                       ([[0]], "shape")):
        with pytest.raises(ValueError, match=match):
            ours.generate(ids, 3, routing=bad)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        ours.generate(ids, 0, return_routing=True)
