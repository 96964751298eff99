"""Record the kernel timelines that notebooks/overlap.ipynb plots (run on a CUDA GPU).

    python notebooks/record_overlap_trace.py notebooks/overlap_trace.json COMMIT

A 4-layer Cohere2-MoE parallel-block model (H=4096, 32 heads, 8 experts of I=8192, top-2, one
shared expert, bf16, random weights) decodes through CUDA graphs with overlap off and on, at
batch 1, 4, 16, 64; one replay of each is profiled. A 512-token prefill is profiled serial and
with the branches forced onto the alternate streams, to show where overlap stops paying.
Only kernel events are kept: name, CUDA stream, start and duration (µs), one step each.
"""
from __future__ import annotations

import datetime
import json
import sys
import tempfile

import torch

from moe_triton.graphs import ForwardMode
from moe_triton.models import default_dtype
from moe_triton.models.cohere2_moe import Cohere2MoeForCausalLM
from moe_triton.models.layers import Batch
from moe_triton.tools.bench import random_init_

BATCHES = (1, 4, 16, 64)


def build_model():
    from transformers import Cohere2MoeConfig

    config = Cohere2MoeConfig(vocab_size=1024, hidden_size=4096, intermediate_size=8192,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              num_hidden_layers=4, num_experts=8,
                              num_experts_per_tok=2, num_shared_experts=1, sliding_window=4096,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = random_init_(Cohere2MoeForCausalLM(config)).eval()
    return config, model


def kernels_of(fn) -> tuple[list[dict], float]:
    """Kernel events of one call of `fn` (after warm-up), times relative to the first kernel."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    return ([dict(name=e["name"][:80], stream=e["args"].get("stream"),
                  start_us=round(e["ts"] - start, 2), dur_us=round(e["dur"], 2))
             for e in sorted(kernels, key=lambda e: e["ts"])], end - start)


def main(path: str, commit: str) -> None:
    config, model = build_model()
    runs = []
    for batch in BATCHES:
        for overlap in (False, True):
            model.use_overlap = overlap
            model.setup(max_batch=batch, max_seq=512, batch_sizes=(batch,))
            inputs = {"token_ids": torch.randint(0, 1024, (batch,), device="cuda"),
                      "positions": torch.full((batch,), 200, device="cuda"),
                      "slots": torch.arange(batch, device="cuda")}
            kernels, span = kernels_of(lambda: model.graphs.run(inputs))
            runs.append(dict(mode="decode", batch=batch, overlap=overlap, span_us=round(span, 1),
                             kernels=kernels))
            print(f"decode batch {batch} overlap {overlap}: {span:.0f} us", flush=True)
    ids = torch.randint(0, 1024, (1, 512), device="cuda")
    slots, positions = (torch.zeros(1, dtype=torch.int64, device="cuda"),
                        torch.arange(512, device="cuda")[None])
    # prefill with the branches forced onto the streams (not the shipped path)
    for overlap in (False, True):
        batch = Batch(ForwardMode.PREFILL, positions, slots, overlap=overlap)
        kernels, span = kernels_of(lambda: model.model(ids, batch, model.cache))
        runs.append(dict(mode="prefill", batch=1, tokens=512, overlap=overlap,
                         span_us=round(span, 1), kernels=kernels))
        print(f"prefill 512 overlap {overlap}: {span:.0f} us", flush=True)
    meta = dict(recorded=datetime.date.today().isoformat(), commit=commit,
                device=torch.cuda.get_device_name(), torch=torch.__version__,
                model=dict(hidden=config.hidden_size, heads=config.num_attention_heads,
                           kv_heads=config.num_key_value_heads,
                           experts=config.num_experts, top_k=config.num_experts_per_tok,
                           intermediate=config.intermediate_size,
                           shared_experts=config.num_shared_experts,
                           layers=config.num_hidden_layers, dtype="bfloat16"))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, runs=runs), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
