"""Parity with transformers' own modules: from_transformers for each supported sparse-MoE block,
and experts_implementation="moe_triton" inside an unmodified transformers model."""
import pytest
import torch
from helpers import all_sparse_qwen3_moe_checkpoint, assert_close, randomize_all_

import moe_triton


def qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=40, num_experts=8,
                                                 num_experts_per_tok=2, norm_topk_prob=norm))


def cohere2_moe(fn, strategy):
    from transformers import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeSparseMoeBlock

    return Cohere2MoeSparseMoeBlock(Cohere2MoeConfig(hidden_size=48, intermediate_size=40, num_experts=8,
                                                     num_experts_per_tok=2, expert_selection_fn=fn,
                                                     num_shared_experts=1, norm_topk_prob=True,
                                                     shared_expert_combination_strategy=strategy))


def minimax_m2():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    return MiniMaxM2SparseMoeBlock(MiniMaxM2Config(hidden_size=48, intermediate_size=40, num_local_experts=8,
                                                   num_experts_per_tok=2))


def minimax_m3():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLSparseMoeBlock

    config = MiniMaxM3VLTextConfig(hidden_size=48, intermediate_size=40, shared_intermediate_size=24,
                                   num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
                                   swiglu_limit=0.7, swiglu_alpha=1.702)
    return MiniMaxM3VLSparseMoeBlock(config)


def nemotron_h(latent):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    config = NemotronHConfig(hidden_size=48, moe_intermediate_size=40, moe_shared_expert_intermediate_size=24,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, moe_latent_size=latent)
    return NemotronHMoE(config)


BLOCKS = {
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
@pytest.mark.parametrize("name", list(BLOCKS))
def test_from_transformers(name, backend):
    block = randomize_all_(BLOCKS[name]().eval(), seed=len(name))
    layer = moe_triton.from_transformers(block, backend=backend)
    assert layer.gate_up_proj.data_ptr() == (block.experts.gate_up_proj if hasattr(block.experts, "gate_up_proj")
                                             else block.experts.up_proj).data_ptr()  # shared, not copied
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        expected, actual = block(x), layer(x)
    assert_close(actual, expected, torch.float32, scale=5)


def test_from_transformers_rejects_unknown_block():
    with pytest.raises(ValueError, match="from_transformers does not know"):
        moe_triton.from_transformers(torch.nn.Linear(2, 2))


def test_experts_implementation_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    logits = {}
    for impl in ("eager", "moe_triton"):
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, dtype=torch.float32).eval()
        assert model.config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(ids).logits
    assert_close(logits["moe_triton"], logits["eager"], torch.float32, scale=10)


def test_experts_implementation_uses_our_kernels(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import moe_triton.integrations.transformers as integration

    calls = []
    real = integration.run_experts
    monkeypatch.setattr(integration, "run_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(all_sparse_qwen3_moe_checkpoint(tmp_path), experts_implementation="moe_triton")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert len(calls) == 2  # one per MoE layer
