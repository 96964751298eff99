"""`moe-triton` (also `python -m moe_triton`): the command line. Environment is read here only."""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _bench_cases(on_gpu: bool):
    from .bench import QWEN3_30B_A3B, LayerShape

    if on_gpu:
        return QWEN3_30B_A3B, [1, 8, 32, 128, 2048]
    return LayerShape("tiny (E=8, K=2, H=128, I=96)", 8, 2, 128, 96), [1, 8, 32]


def _restart_with_interpreter() -> None:
    """Kernels are bound to the interpreter when defined, i.e. at import: start again with it on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    os.execve(sys.executable, [sys.executable, "-m", "moe_triton", *sys.argv[1:]], env)


def bench(args) -> int:
    from tqdm import tqdm

    from . import fused_experts
    from .bench import (capture_graph, floor_seconds, layer_bytes, layer_flops, measure_ceilings, random_experts,
                        random_inputs, time_cpu, time_eager, time_graph_replays)
    from .platform import interpreter_enabled

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not interpreter_enabled():
        _restart_with_interpreter()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16  # the interpreter's bf16 dot is unreliable
    shape, tokens = _bench_cases(on_gpu)
    tokens = args.tokens or tokens
    where = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter (correctness path, NOT a performance number)"
    print(f"moe-triton bench: {shape.name} E={shape.num_experts} K={shape.top_k} H={shape.hidden_size} "
          f"I={shape.intermediate_size}, {dtype}, on {where}")
    ceilings = measure_ceilings(device) if on_gpu else None
    w13, w2 = random_experts(shape, dtype, device)
    rows = []
    for T in tqdm(tokens, desc="timing", unit="case"):
        inputs = random_inputs(shape, T, dtype, device, num_variants=4)
        step = lambda i: fused_experts(inputs.hidden_states[i], w13, w2, inputs.topk_ids[i], inputs.topk_weights[i])  # noqa: E731
        if not on_gpu:
            rows.append((T, time_cpu(step), None, "wall"))
            continue
        seconds = time_graph_replays(capture_graph(step, 4), 4) if T <= 256 else time_eager(step, 4)
        floor = floor_seconds(sum(layer_bytes(shape, ids) for ids in inputs.topk_ids) / 4, layer_flops(shape, T), ceilings)
        rows.append((T, seconds, floor, "graph" if T <= 256 else "do_bench"))
    if ceilings:
        print(f"ceilings measured now: copy {ceilings.bandwidth / 1e12:.2f} TB/s, bf16 matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>8} {'time_us':>12} {'floor_us':>10} {'of floor':>9}  timing")
    for T, seconds, floor, how in rows:
        floor_text = f"{floor * 1e6:10.1f} {floor / seconds:8.0%}" if floor else f"{'-':>10} {'-':>9}"
        print(f"{T:>8} {seconds * 1e6:12.1f} {floor_text}  {how}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-triton", description="Triton MoE expert layer tools")
    commands = parser.add_subparsers(dest="command", required=True)
    bench_parser = commands.add_parser("bench", help="time the expert layer on a built-in shape")
    bench_parser.add_argument("--tokens", type=int, nargs="+", help="token counts to time")
    bench_parser.add_argument("--cpu", action="store_true", help="use the CPU interpreter even if a GPU is present")
    bench_parser.set_defaults(run=bench)
    args = parser.parse_args(argv)
    return args.run(args)
