"""Measurement helpers only benchmarks need: per-stage GPU times from the profiler, CUDA-event
medians of whole calls, transformers' own experts over our weights as the peer."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from moe_triton.tools.bench import LayerShape


def stage_times(step: Callable[[int], object], num_variants: int, calls: int = 8) -> dict[str, float]:
    """GPU seconds per call of each stage of `step` (fused_experts): expand, up, down, finalize.

    From torch.profiler's kernel records of `calls` eager calls: the expand kernels are summed,
    the expert GEMM kernels alternate up, down within each call, anything else (a memset) is "other".
    """
    for i in range(num_variants):
        step(i)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for i in range(calls):
            step(i % num_variants)
        torch.cuda.synchronize()
    kernels = sorted((e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    totals: dict[str, float] = {}
    gemms = 0
    for event in kernels:
        if "expert_gemm" in event.name:
            name = ("up", "down")[gemms % 2]
            gemms += 1
        elif any(kernel in event.name for kernel in ("histogram", "expert_offsets", "scatter_pairs")):
            name = "expand"  # _expand_kernels.py
        elif "finalize" in event.name:
            name = "finalize"
        else:
            name = "other"
        totals[name] = totals.get(name, 0.0) + event.time_range.elapsed_us() * 1e-6 / calls
    return totals



def transformers_experts(shape: LayerShape, w13: torch.Tensor, w2: torch.Tensor, implementation: str):
    """transformers' own Qwen3MoeExperts over the same weights, set to `implementation`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=shape.hidden_size, moe_intermediate_size=shape.intermediate_size,
                            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, hidden_act="silu")
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return experts



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
