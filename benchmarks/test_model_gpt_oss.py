"""gpt-oss at full size (issue 32): gpt-oss-120b- and gpt-oss-20b-shaped models built through
moe_triton.models as load_model builds them from an MXFP4 checkpoint (their real configs, random
weights drawn on the GPU: bf16 attention / router / head, MXFP4 experts of random codes and
scales; 120b ~65 GB), never written to a checkpoint.

- Decode: one step through the model's CUDA graphs at batch 1, 8, 32, 64, every sequence at
  context 1k, against the step's byte floor (measure.gpt_oss_decode_step_bytes: every weight the
  step reads at its stored size, the experts the batch hits, the K/V of the context, a sliding
  layer's only its window) over the copy bandwidth B measured in the same run.
- Prefill: one sequence of 2k and 8k tokens (eager, as prefill runs) against its compute floor
  (measure.prefill_flops over the bf16 matmul rate F of the same run).

Targets (issue 32): 120b batch 1 <= 1.5x its floor (floor_frac >= 0.67), batch 32 >= 0.80;
prefill at 8k >= 0.5 of its compute floor.

    python -m pytest benchmarks/test_model_gpt_oss.py -m gpu --benchmark-only
        --bench-table gpt-oss.md
"""
import pytest
import torch
from measure import (
    event_median_seconds,
    gpt_oss_config,
    gpt_oss_decode_step_bytes,
    prefill_flops,
    random_mxfp4_,
    record_where_time_goes,
)

from moe_triton.context import ModelContext
from moe_triton.models import default_dtype
from moe_triton.placement import Placement

BATCHES = (1, 8, 32, 64)
CONTEXT = 1024
PREFILL = (2048, 8192)
# gpt-oss's config.json (attention, router, embeddings and head stay bf16)
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def build(size: str):
    from moe_triton.models.gpt_oss import GptOssForCausalLM

    config = gpt_oss_config(size)
    context = ModelContext.from_config({"architectures": config.architectures,
                                        "quantization_config": MXFP4})
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_mxfp4_(GptOssForCausalLM(config, Placement(context=context)))
    for layer in model.model.layers:
        layer.mlp.prepare_weights()
    return model


def free(model) -> None:
    model.cache = model.graphs = None
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["120b", "20b"])
def test_gpt_oss_decode_and_prefill(benchmark, size, ceilings, record):
    model = build(size)
    config, layers = model.config, model.config.num_hidden_layers
    assert {layer.mlp.backend for layer in model.model.layers} == {"triton"}
    for batch in BATCHES:
        free(model)
        model.setup(max_batch=batch, max_seq=CONTEXT + 8, batch_sizes=(batch,))
        inputs = {"token_ids": torch.randint(0, config.vocab_size, (batch,), device="cuda"),
                  "positions": torch.full((batch,), CONTEXT - 1, device="cuda"),
                  "slots": torch.arange(batch, device="cuda")}
        step_s = event_median_seconds(lambda: model.graphs.run(inputs))
        floor_s = gpt_oss_decode_step_bytes(config, batch, CONTEXT) / ceilings.bandwidth
        record(f"gpt-oss-{size}-shaped decode step, MXFP4 experts, bf16, through graphs, "
               f"context {CONTEXT}", dict(
                   batch=batch, step_us=f"{step_s * 1e6:.0f}", floor_us=f"{floor_s * 1e6:.0f}",
                   floor_frac=f"{floor_s / step_s:.2f}", tokens_per_s=f"{batch / step_s:.0f}"))
        if batch == 1 and size == "120b":
            record_where_time_goes(record, f"Where a gpt-oss-{size} decode step goes: batch 1, "
                                   "one replay", lambda: model.graphs.run(inputs), step_s, layers,
                                   top=12)
    for tokens in PREFILL:
        free(model)
        model.setup(max_batch=1, max_seq=tokens, batch_sizes=(1,))
        ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
        seconds = event_median_seconds(lambda: model.prefill_last(ids), iterations=3)
        floor_s = prefill_flops(config, tokens) / ceilings.matmul_flops
        record(f"gpt-oss-{size}-shaped prefill, one sequence, MXFP4 experts (eager)", dict(
            tokens=tokens, prefill_ms=f"{seconds * 1e3:.1f}", floor_ms=f"{floor_s * 1e3:.1f}",
            compute_frac=f"{floor_s / seconds:.2f}", tokens_per_s=f"{tokens / seconds:.0f}"))
        if tokens == PREFILL[-1] and size == "120b":
            record_where_time_goes(record, f"Where a gpt-oss-{size} prefill of {tokens} tokens "
                                   "goes", lambda: model.prefill_last(ids), seconds, layers,
                                   top=12)
    free(model)
    benchmark.pedantic(lambda: None, rounds=1)  # the tables are the result
