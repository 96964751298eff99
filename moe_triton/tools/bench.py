"""Timing and roofline helpers of `moe-triton bench`, benchmarks/ and the GPU tests: every time
beside its floor max(bytes / B, FLOPs / F), B (a copy) and F (a bf16 matmul) measured in the run."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..graphs import capture_graph


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, read + written, of a large device-to-device copy
    matmul_flops: float  # FLOP/s of a large bf16 matmul on random data
    fp8_matmul_flops: float = float("nan")  # FLOP/s of a large FP8 torch._scaled_mm, bf16 out


@dataclass(frozen=True)
class LayerShape:
    name: str
    num_experts: int  # E
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I


QWEN3_30B_A3B = LayerShape("Qwen3-30B-A3B", 128, 8, 2048, 768)
MIXTRAL_8X7B = LayerShape("Mixtral-8x7B", 8, 2, 4096, 14336)
DEEPSEEK_V3 = LayerShape("DeepSeek-V3", 256, 8, 7168, 2048)
E64_K4 = LayerShape("E64-K4", 64, 4, 4096, 1536)
GRID_SHAPES = {shape.name: shape for shape in (QWEN3_30B_A3B, MIXTRAL_8X7B, DEEPSEEK_V3, E64_K4)}
# gpt-oss's expert layers (MXFP4 in their checkpoints; biases, clamped swiglu)
GPT_OSS_120B = LayerShape("gpt-oss-120b", 128, 4, 2880, 2880)
GPT_OSS_20B = LayerShape("gpt-oss-20b", 32, 4, 2880, 2880)


def layer_bytes(shape: LayerShape, topk_ids: torch.Tensor, dtype_bytes: float = 2,
                scale_bytes: int = 0) -> int:
    """Fewest bytes moved: each hit expert's weights once (+ `scale_bytes`), bf16 in and out."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    ids = topk_ids[(topk_ids >= 0) & (topk_ids < E)]
    experts_hit = int(torch.unique(ids).numel())
    T = topk_ids.shape[0]
    return int(experts_hit * (3 * H * I * dtype_bytes + scale_bytes)) + 2 * T * H * 2


def layer_flops(shape: LayerShape, num_tokens: int) -> int:
    return 2 * num_tokens * shape.top_k * 3 * shape.hidden_size * shape.intermediate_size


def floor_seconds(bytes_moved: int, flops: int, ceilings: Ceilings, fp8: bool = False) -> float:
    return max(bytes_moved / ceilings.bandwidth,
               flops / (ceilings.fp8_matmul_flops if fp8 else ceilings.matmul_flops))


def measure_ceilings(device: torch.device) -> Ceilings:
    """B, F and F8 on this GPU now (a 1 GiB copy; 8192^3 bf16 and FP8 matmuls on random data)."""
    from triton.testing import do_bench

    src = torch.randn(256 * 2**20, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T  # _scaled_mm: b column-major
    one = torch.ones((), device=device)
    fp8_ms = do_bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                      warmup=50, rep=300, return_mode="median")
    flops = 2 * 8192**3
    return Ceilings(2 * src.numel() * 4 / (copy_ms * 1e-3), flops / (mm_ms * 1e-3),
                    flops / (fp8_ms * 1e-3))


def time_graph_replays(graph: torch.cuda.CUDAGraph, num_variants: int, replays: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / num_variants)
    return statistics.median(times)


def time_eager(step: Callable[[int], object], num_variants: int) -> float:
    """Seconds per call: do_bench's median, L2 flushed between calls."""
    from triton.testing import do_bench

    counter = iter(range(10**9))
    return do_bench(lambda: step(next(counter) % num_variants), warmup=25, rep=200,
                    return_mode="median") * 1e-3


def time_step(step: Callable[[int], object], num_variants: int,
              graphable: bool) -> tuple[float, str]:
    """Seconds per call and how: graph replays when capturable, else do_bench (grouped_mm)."""
    if graphable:
        try:
            return time_graph_replays(capture_graph(step, num_variants), num_variants), "graph"
        except RuntimeError:
            torch.cuda.synchronize()
    return time_eager(step, num_variants), "eager"


def time_cpu(step: Callable[[int], object], repeats: int = 3) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class LayerInputs:
    hidden_states: list[torch.Tensor]  # num_variants x [T, H]
    topk_ids: list[torch.Tensor]  # num_variants x [T, K] int32
    topk_weights: list[torch.Tensor]  # num_variants x [T, K] float32


def random_experts(shape: LayerShape, dtype: torch.dtype, device, seed: int = 0):
    """w13 (E, 2I, H) and w2 (E, H, I), scaled so activations stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
    w13 = torch.randn(E, 2 * I, H, generator=g, device=device, dtype=dtype).div_(H**0.5)
    w2 = torch.randn(E, H, I, generator=g, device=device, dtype=dtype).div_(I**0.5)
    return w13, w2


def random_inputs(shape: LayerShape, num_tokens: int, dtype: torch.dtype, device,
                  num_variants: int = 4, seed: int = 1) -> LayerInputs:
    """Hidden states and softmax top-k routing of random (never zero) logits."""
    g = torch.Generator(device=device).manual_seed(seed)
    inputs = LayerInputs([], [], [])
    for _ in range(num_variants):
        logits = torch.randn(num_tokens, shape.num_experts, generator=g, device=device)
        weights, ids = torch.topk(logits.softmax(dim=-1), shape.top_k, dim=-1)
        inputs.hidden_states.append(torch.randn(num_tokens, shape.hidden_size, generator=g,
                                                device=device, dtype=dtype))
        inputs.topk_ids.append(ids.int())
        inputs.topk_weights.append(weights)
    return inputs


def branch_stack_capture_bytes(num_layers: int, stream_per_layer: bool, tokens: int = 2048,
                               hidden: int = 2048, device="cuda") -> int:
    """Graph-pool bytes of a stack whose layers branch on a stream each, or on the "alt" role:
    blocks are never reused across streams, so per-layer streams keep every branch's alive."""
    from ..graphs import run_branches

    g = torch.Generator(device=device).manual_seed(0)
    up = (torch.randn(hidden, 4 * hidden, generator=g, device=device, dtype=torch.bfloat16)
          / hidden**0.5)
    down = (torch.randn(4 * hidden, hidden, generator=g, device=device, dtype=torch.bfloat16)
            / (4 * hidden) ** 0.5)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)

    def mlp(h):
        return torch.nn.functional.gelu(h @ up) @ down

    def stack(h):
        for layer in range(num_layers):
            role = f"layer{layer}" if stream_per_layer else "alt"
            main, side = run_branches(lambda h=h: mlp(h), lambda h=h: mlp(h), role=role)
            h = h + main + side
        return h

    stack(x)  # warm-up outside capture
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stack(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved(device) - before
    del graph, out
    torch.cuda.empty_cache()
    return used


def random_init_(module: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module
