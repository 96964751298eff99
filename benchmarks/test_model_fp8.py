"""Decode step of a real-size Qwen3-30B-A3B-shaped model, FP8 against bf16 (issue 14's speed table).

The model is Qwen3-30B-A3B's config (48 layers, H=2048, 128 experts of I=768, top-8, 32 query / 4 KV
heads of 128) with random weights built on the GPU: bf16 drawn there, and for the FP8 model the
experts quantized there to 128 x 128 blocks (ExpertWeights.to_format; ~31 GB in all), never written
to a checkpoint. Attention and the head stay bf16, as the loader leaves them (FP8 linears outside the
experts are dequantized at load). Both models decode through CUDA graphs at batch 1, 8, 32, 64, one
after the other in the same run (they do not fit together with room to spare).

Floor = bytes / B, B the copy bandwidth measured in the same run: every weight a decode step reads
(per layer: attention, the router, norms, and the experts the batch hits under uniform routing,
E (1 - (1 - K/E)^batch) of them, with their scales; the LM head) plus the KV cache the attention
reads (SDPA over the whole static cache row: max_seq positions of every sequence, K and V).
Targets (issue 14): FP8 step <= 0.6x the bf16 step at batch 1, and <= 1.3x its own floor.

Results (H200): docs/PERFORMANCE.md, "FP8 checkpoints: a real-size decode step". Run on the H200:
    python -m pytest benchmarks/test_model_fp8.py -m gpu --benchmark-only --bench-table fp8-model.md
"""
import gc

import pytest
import torch
from measure import event_median_seconds

from moe_triton import ExpertWeights, FusedMoE, ModelContext, Placement, WeightFormat
from moe_triton.models import default_dtype

BATCHES = (1, 8, 32, 64)
MAX_SEQ = 512
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def qwen3_30b_a3b_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                          max_position_embeddings=40960, tie_word_embeddings=False)


@torch.no_grad()
def build(config, fp8: bool):
    """The model on the GPU with random weights; FP8 experts quantized there, one layer at a time."""
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    context = ModelContext("Qwen3MoeForCausalLM", FP8 if fp8 else None)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = Qwen3MoeForCausalLM(config, Placement(context=context))
    for p in model.parameters():
        if p.dtype in (torch.bfloat16, torch.float32):
            p.normal_(0, 0.02)
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE) and m.weight_format.fp8 is not None):
        E, H, I = layer.gate_up_proj.shape[0], layer.gate_up_proj.shape[2], layer.down_proj.shape[2]
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, 2I, H]
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, H, I]
        quantized = ExpertWeights(w13, w2).to_format(layer.weight_format)
        for name, field in (("gate_up_proj", "w13"), ("down_proj", "w2"), ("gate_up_proj_scale", "w13_scale"),
                            ("down_proj_scale", "w2_scale")):
            getattr(layer, name).copy_(getattr(quantized, field))
        del w13, w2, quantized
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        layer.prepare_weights()
    return model.eval()


def step_bytes(config, batch: int, fp8: bool) -> float:
    """Bytes one decode step reads (see the module docstring)."""
    H, I, E, K = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    D, Hq, Hkv, L = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    hit = E * (1 - (1 - K / E) ** batch)
    if fp8:
        blocks = 2 * -(-I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128)
        expert = 3 * I * H + 4 * blocks  # e4m3 weights, float32 block scales
    else:
        expert = 3 * I * H * 2
    attention = (2 * H * Hq * D + 2 * H * Hkv * D) * 2
    router_norms = E * H * 2 + (2 * H + 2 * D) * 2
    kv_cache = 2 * batch * Hkv * MAX_SEQ * D * 2
    head = config.vocab_size * H * 2 + batch * H * 2  # LM head, and the embedding rows
    return L * (hit * expert + attention + router_norms + kv_cache) + head


@pytest.fixture(scope="module")
def config():
    return qwen3_30b_a3b_config()


def decode_times(config, fp8: bool) -> dict[int, float]:
    """Median decode-step seconds per batch through graphs; the model is freed on return."""
    model, times = build(config, fp8), {}
    for batch in BATCHES:
        model.setup(max_batch=batch, max_seq=MAX_SEQ, batch_sizes=(batch,))
        inputs = {"token_ids": torch.randint(0, config.vocab_size, (batch,), device="cuda"),
                  "positions": torch.full((batch,), 100, device="cuda"), "slots": torch.arange(batch, device="cuda")}
        times[batch] = event_median_seconds(lambda: model.graphs(inputs))
    return times


@pytest.mark.gpu
def test_qwen3_30b_a3b_fp8_decode_against_bf16(benchmark, config, ceilings, record):
    times = {}
    for fp8 in (True, False):
        times.update({(fp8, batch): t for batch, t in decode_times(config, fp8).items()})
        gc.collect()
        torch.cuda.empty_cache()
    for batch in BATCHES:
        fp8_s, bf16_s = times[True, batch], times[False, batch]
        floor_s = step_bytes(config, batch, fp8=True) / ceilings.bandwidth
        record("Qwen3-30B-A3B decode step, 48 layers, FP8 128x128 experts vs bf16 (graphs)", dict(
            batch=batch, fp8_us=f"{fp8_s * 1e6:.0f}", bf16_us=f"{bf16_s * 1e6:.0f}", fp8_vs_bf16=f"{fp8_s / bf16_s:.2f}",
            floor_us=f"{floor_s * 1e6:.0f}", fp8_of_floor=f"{fp8_s / floor_s:.2f}",
            bf16_floor_us=f"{step_bytes(config, batch, fp8=False) / ceilings.bandwidth * 1e6:.0f}"))
    benchmark.extra_info.update(model="Qwen3-30B-A3B-shaped, random", format=str(WeightFormat.fp8_block()),
                                times_us={f"{'fp8' if k[0] else 'bf16'}-{k[1]}": v * 1e6 for k, v in times.items()})
    benchmark.pedantic(lambda: None, rounds=1)  # the table is the result; --benchmark-only runs only benchmark tests
