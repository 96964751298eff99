"""Measurement helpers only benchmarks need: per-stage GPU times from the profiler, CUDA-event
medians of whole calls, transformers' own experts over our weights as the peer."""
from __future__ import annotations

import os
import statistics
import subprocess
from collections.abc import Callable

import torch

from moe_triton.tools.bench import LayerShape


def stage_times(step: Callable[[int], object], num_variants: int,
                calls: int = 8) -> dict[str, float]:
    """GPU seconds per call of each stage of `step` (fused_experts): expand, up, down, finalize.

    From torch.profiler's kernel records of `calls` eager calls: the expand kernels are summed,
    the expert GEMM kernels alternate up, down within each call, anything else (a memset) is
    "other".
    """
    for i in range(num_variants):
        step(i)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for i in range(calls):
            step(i % num_variants)
        torch.cuda.synchronize()
    kernels = sorted((e for e in profile.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    totals: dict[str, float] = {}
    gemms = 0
    for event in kernels:
        if "expert_gemm" in event.name:
            name = ("up", "down")[gemms % 2]
            gemms += 1
        elif any(kernel in event.name
                 for kernel in ("histogram", "expert_offsets", "scatter_pairs", "expand_one")):
            name = "expand"  # _expand_kernels.py
        elif "finalize" in event.name:
            name = "finalize"
        else:
            name = "other"
        totals[name] = totals.get(name, 0.0) + event.time_range.elapsed_us() * 1e-6 / calls
    return totals



def transformers_experts(shape: LayerShape, w13: torch.Tensor, w2: torch.Tensor,
                         implementation: str):
    """transformers' own Qwen3MoeExperts over the same weights, set to `implementation`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=shape.hidden_size,
                            moe_intermediate_size=shape.intermediate_size,
                            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                            hidden_act="silu")
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return experts



def transformers_fp8_experts(experts: torch.nn.Module, config, block=(128, 128)):
    """transformers' FP8Experts (as its loader decorates it) holding `experts`' weights quantized
    by transformers' own Fp8Quantize to `block` scales."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import (
        ALL_FP8_EXPERTS_FUNCTIONS,
        FP8Experts,
        Fp8Quantize,
    )
    from transformers.integrations.moe import use_experts_implementation
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    fp8_class = use_experts_implementation(experts_class=type("FP8Experts", (FP8Experts,), {}),
                                           experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    with torch.device("meta"):
        fp8 = fp8_class(config, block_size=list(block), activation_scheme="dynamic")
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(
        FineGrainedFP8Config(weight_block_size=list(block))))
    for name in ("gate_up_proj", "down_proj"):
        quantized = quantize._quantize_one(name, getattr(experts, name).detach())
        for key, tensor in quantized.items():
            setattr(fp8, key, torch.nn.Parameter(tensor, requires_grad=False))
    return fp8


def event_median_seconds(fn: Callable[[], object], iterations: int = 30) -> float:
    """Median seconds of `fn` between CUDA events (host launch gaps included), after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


# ---- a full-size model (Qwen3-30B-A3B's config), its decode step's bytes -------------------------

def interleaved_layer_seconds(shape: LayerShape, weights, M: int, variants: dict[str, Callable],
                              rounds: int = 3, num_inputs: int = 4) -> dict[str, float]:
    """Seconds per run_experts call of each variant (name -> run_experts-like fn(x, weights, ids,
    topk_weights)) at M tokens: CUDA-graph replays of `num_inputs` calls over rotated inputs (the
    grid benchmark's timing), the variants' graphs captured first, then timed in turn over
    `rounds` rounds; each variant's median."""
    from moe_triton.graphs import capture_graph
    from moe_triton.tools.bench import random_inputs, time_graph_replays

    inputs = random_inputs(shape, M, torch.bfloat16, "cuda", num_inputs)
    graphs = {}
    for name, fn in variants.items():
        graphs[name] = capture_graph(
            lambda i, fn=fn: fn(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                                inputs.topk_weights[i]), num_inputs)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(time_graph_replays(graph, num_inputs, replays=20))
    return {name: statistics.median(t) for name, t in times.items()}


def qwen3_30b_a3b_config(num_layers: int = 48):
    """Qwen3-30B-A3B's config (48 layers, H=2048, 128 experts of I=768, top-8, 32 / 4 heads of
    128)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=num_layers,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          rms_norm_eps=1e-6,
                          max_position_embeddings=40960, tie_word_embeddings=False)


@torch.no_grad()
def random_weights_(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """Every non-FP8 parameter drawn from N(0, std) in place, where it lives (e.g. on the GPU); eval
    mode. FP8 tensors are left for the caller to quantize into (normal_ has no float8 kernel)."""
    for p in model.parameters():
        if p.element_size() > 1:
            p.normal_(0, std)
    return model.eval()


def decode_step_bytes(config, batch: int, context: int, fp8: bool = False) -> float:
    """Bytes one decode step must read: per layer attention, router and norms, the experts the batch
    hits under uniform routing (E (1 - (1 - K/E)^batch) of them, with their 128 x 128 block scales
    when FP8), the K/V of `context` positions of every sequence; the LM head and embedding rows."""
    H, I, E, K = (config.hidden_size, config.moe_intermediate_size, config.num_experts,
                  config.num_experts_per_tok)
    D, Hq, Hkv, L = (config.head_dim, config.num_attention_heads, config.num_key_value_heads,
                     config.num_hidden_layers)
    hit = E * (1 - (1 - K / E) ** batch)
    if fp8:
        blocks = 2 * -(-I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128)
        expert = 3 * I * H + 4 * blocks  # e4m3 weights, float32 block scales
    else:
        expert = 3 * I * H * 2
    attention = (2 * H * Hq * D + 2 * H * Hkv * D) * 2
    router_norms = E * H * 2 + (2 * H + 2 * D) * 2
    kv_cache = 2 * batch * Hkv * context * D * 2
    head = config.vocab_size * H * 2 + batch * H * 2  # LM head, and the embedding rows
    return L * (hit * expert + attention + router_norms + kv_cache) + head


def kernel_times(fn: Callable[[], object]) -> dict[str, list[float]]:
    """GPU microseconds of each kernel one call of `fn` runs, by name (60 characters), through
    torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(event.name[:60], []).append(event.time_range.elapsed_us())
    return by_name


def record_where_time_goes(record, table: str, fn: Callable[[], object], seconds: float,
                           layers: int, top: int | None = None) -> None:
    """A row per kernel of one call of `fn` (`seconds` long, timed apart) by GPU time: launches a
    layer, µs and share of the call; the `top` first alone and the rest summed (None: all), and
    the time no kernel ran (negative where kernels overlap: PDL launches early)."""
    by_name = kernel_times(fn)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    call_us = seconds * 1e6

    def row(kernel: str, per_layer: str, us: float) -> None:
        record(table, dict(kernel=kernel, per_layer=per_layer, us=f"{us:.0f}",
                           share=f"{us / call_us:.1%}"))

    for name, times in ranked[:top]:
        row(name, f"{len(times) / layers:.2f}", sum(times))
    if top is not None and len(ranked) > top:
        row(f"({len(ranked) - top} other kernels)", "-",
            sum(sum(times) for _, times in ranked[top:]))
    row("(idle between kernels)", "-", call_us - sum(sum(t) for t in by_name.values()))


def gpt_oss_config(size: str = "120b"):
    """gpt-oss-120b's config (36 layers, H = I = 2880, 128 experts top-4, 64 / 8 heads of 64,
    sliding window 128 on every other layer, YaRN), or gpt-oss-20b's (24 layers, 32 experts)."""
    from transformers import GptOssConfig

    layers, experts = {"120b": (36, 128), "20b": (24, 32)}[size]
    config = GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                          num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=64, num_local_experts=experts, num_experts_per_tok=4,
                          sliding_window=128, max_position_embeddings=131072,
                          tie_word_embeddings=False)
    config.architectures = ["GptOssForCausalLM"]
    return config


@torch.no_grad()
def random_mxfp4_(model: torch.nn.Module) -> torch.nn.Module:
    """random_weights_, then every MXFP4 expert tensor in place: random e2m1 codes, E8M0 scales
    2^-8 .. 2^-6 (weights of about 0.01-0.05, as trained experts' are)."""
    random_weights_(model)
    for name, p in model.named_parameters():
        if p.dtype == torch.uint8:
            if name.endswith("_scale"):
                p.random_(127 - 8, 127 - 5)
            else:
                p.random_(0, 256)
    return model


def gpt_oss_decode_step_bytes(config, batch: int, context: int) -> float:
    """Bytes one gpt-oss decode step must read, MXFP4 experts: per layer q/k/v/o (bf16, biases,
    sinks), router and norms, the experts the batch hits under uniform routing (packed e2m1, E8M0
    scales, bf16 biases), the K/V of the context (a sliding layer: its window); the LM head and
    embedding rows."""
    H, I, E, K = (config.hidden_size, config.intermediate_size, config.num_local_experts,
                  config.num_experts_per_tok)
    D, Hq, Hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    hit = E * (1 - (1 - K / E) ** batch)
    expert = 3 * I * H // 2 + 3 * I * H // 32 + (2 * I + H) * 2
    attention = (2 * H * Hq * D + 2 * H * Hkv * D + Hq * D + 2 * Hkv * D + H + Hq) * 2
    router_norms = (E * H + E) * 2 + 2 * H * 2
    total = 0.0
    for layer_type in config.layer_types:
        seen = min(context, config.sliding_window) if layer_type == "sliding_attention" else context
        total += hit * expert + attention + router_norms + 2 * batch * Hkv * seen * D * 2
    return total + config.vocab_size * H * 2 + batch * H * 2


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of one prompt's prefill up to its last token's logits: projections, router, the
    experts each token runs (K of them), causal attention (a sliding layer: its window); every
    layer sparse (Qwen3-30B-A3B's and gpt-oss's are)."""
    H, K = config.hidden_size, config.num_experts_per_tok
    I = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    E = getattr(config, "num_experts", None) or config.num_local_experts
    D, Hq, Hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    per_token = 2 * (2 * H * Hq * D + 2 * H * Hkv * D + E * H + K * 3 * H * I)
    layer_types = (getattr(config, "layer_types", None)
                   or ["full_attention"] * config.num_hidden_layers)
    total = 0.0
    for layer_type in layer_types:
        if layer_type == "sliding_attention":
            pairs = sum(min(t + 1, config.sliding_window) for t in range(tokens))
        else:
            pairs = tokens * (tokens + 1) / 2
        total += tokens * per_token + 4 * pairs * Hq * D  # QK^T and PV
    return total + 2 * config.vocab_size * H


def commit() -> str:
    """The tree's commit: MOE_TRITON_COMMIT where the checkout is a copy (the GPU machine's)."""
    if os.environ.get("MOE_TRITON_COMMIT"):
        return os.environ["MOE_TRITON_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
