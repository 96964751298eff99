"""Decode step of a real-size Qwen3-30B-A3B-shaped model, FP8 against bf16 (issue 14's speed table).

The model is Qwen3-30B-A3B's config (48 layers, H=2048, 128 experts of I=768, top-8, 32 query / 4 KV
heads of 128) with random weights built on the GPU: bf16 drawn there, and for the FP8 model the
experts quantized there to 128 x 128 blocks (ExpertWeights.to_format; ~31 GB in all), never written
to a checkpoint. Attention and the head stay bf16, as the loader leaves them (FP8 linears outside
the experts are dequantized at load). Both models decode through CUDA graphs at batch 1, 8, 32, 64,
one after the other in the same run (they do not fit together with room to spare).

Floor = bytes / B, B the copy bandwidth measured in the same run: every weight a decode step reads
(per layer: attention, the router, norms, and the experts the batch hits under uniform routing,
E (1 - (1 - K/E)^batch) of them, with their scales; the LM head) plus the KV cache the attention
reads (the in-place decode attention reads each sequence's real context: POSITION + 1 positions).
Targets (issue 14): FP8 step <= 0.6x the bf16 step at batch 1, and <= 1.3x its own floor.

Results (H200): docs/PERFORMANCE.md, "FP8 checkpoints: a real-size decode step". Run on the H200:
    python -m pytest benchmarks/test_model_fp8.py -m gpu --benchmark-only --bench-table fp8-model.md
"""
import gc

import pytest
import torch
from measure import decode_step_bytes, event_median_seconds, qwen3_30b_a3b_config, random_weights_

from moe_triton import ExpertWeights, FusedMoE, ModelContext, Placement, WeightFormat
from moe_triton.models import default_dtype

BATCHES = (1, 8, 32, 64)
MAX_SEQ = 512
POSITION = 100  # every sequence's new token sits here: a context of 101 positions
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}


@torch.no_grad()
def build(config, fp8: bool):
    """The model on the GPU with random weights; FP8 experts quantized there, one layer at a
    time."""
    from moe_triton.models.qwen3_moe import Qwen3MoeForCausalLM

    context = ModelContext("Qwen3MoeForCausalLM", FP8 if fp8 else None)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = Qwen3MoeForCausalLM(config, Placement(context=context))
    random_weights_(model)  # FP8 experts: quantized into below
    for layer in (m for m in model.modules()
                  if isinstance(m, FusedMoE) and m.weight_format.fp8 is not None):
        E, H, I = layer.gate_up_proj.shape[0], layer.gate_up_proj.shape[2], layer.down_proj.shape[2]
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, 2I, H]
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, H, I]
        quantized = ExpertWeights(w13, w2).to_format(layer.weight_format)
        for name, field in (("gate_up_proj", "w13"), ("down_proj", "w2"),
                            ("gate_up_proj_scale", "w13_scale"), ("down_proj_scale", "w2_scale")):
            getattr(layer, name).copy_(getattr(quantized, field))
        del w13, w2, quantized
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        layer.prepare_weights()
    return model.eval()


@pytest.fixture(scope="module")
def config():
    return qwen3_30b_a3b_config()


def decode_times(config, fp8: bool) -> dict[int, float]:
    """Median decode-step seconds per batch through graphs; the model is freed on return."""
    model, times = build(config, fp8), {}
    for batch in BATCHES:
        model.setup(max_batch=batch, max_seq=MAX_SEQ, batch_sizes=(batch,))
        inputs = {"token_ids": torch.randint(0, config.vocab_size, (batch,), device="cuda"),
                  "positions": torch.full((batch,), POSITION, device="cuda"),
                  "slots": torch.arange(batch, device="cuda")}
        times[batch] = event_median_seconds(lambda: model.graphs.run(inputs))
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
        floor_s = decode_step_bytes(config, batch, POSITION + 1, fp8=True) / ceilings.bandwidth
        record("Qwen3-30B-A3B decode step, 48 layers, FP8 128x128 experts vs bf16 (graphs)", dict(
            batch=batch, fp8_us=f"{fp8_s * 1e6:.0f}", bf16_us=f"{bf16_s * 1e6:.0f}",
            fp8_vs_bf16=f"{fp8_s / bf16_s:.2f}",
            floor_us=f"{floor_s * 1e6:.0f}", fp8_of_floor=f"{fp8_s / floor_s:.2f}",
            bf16_floor_us=f"{decode_step_bytes(config, batch, POSITION + 1) / ceilings.bandwidth * 1e6:.0f}"))  # noqa: E501
    benchmark.extra_info.update(model="Qwen3-30B-A3B-shaped, random",
                                format=str(WeightFormat.fp8_block()),
                                times_us={f"{'fp8' if k[0] else 'bf16'}-{k[1]}": v * 1e6
                                          for k, v in times.items()})
    # the table is the result; --benchmark-only runs only benchmark tests
    benchmark.pedantic(lambda: None, rounds=1)
