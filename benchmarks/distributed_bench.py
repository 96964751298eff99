"""Dispatch / combine / reduction time vs expert compute, per rank, for EP and TP over
torch.distributed.

    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --out dist.md

For each layer shape, parallel mode and tokens per rank (decode and prefill sizes) one layer is
timed phase by phase, from the same public pieces `parallel_experts` composes:

    dispatch (sizes + all-to-all, with its host sync) -> experts (local pipeline)
        -> combine -> reduce

then end to end through `parallel_experts` itself, and beside it one GPU running the full layer on
this rank's tokens. A second table, at decode sizes, replays CUDA graphs captured in graphs'
capture mode (all-to-all EP then takes its gathered, capture-safe dispatch): the whole EP layer,
its dispatch + combine alone, and the TP layer on the same tokens, for issue 19's targets (EP layer
<= 1.2x TP, dispatch + combine <= 100 µs at <= 64 tokens per rank). Times are medians of each
rank, then the slowest rank (the layer waits for it). Bytes are what one rank sends; `comm GB/s`
is those bytes over the communication time. `experts TFLOP/s` counts the rank's routed pairs:
2 * pairs * 3 * H * I/tp.

Without CUDA (a smoke test of this script) it runs on gloo with a tiny float32 shape and the
torch reference as local experts: Triton's interpreter gets bf16 dots wrong.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from itertools import pairwise

import torch

# Entry point: the environment is read and set here, before CUDA, NCCL or moe_triton initialise.
# NVLink multicast (NVLS) stays off on the shared H200 machines (issue 8).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NO_MULTICAST.items():
    os.environ.setdefault(_name, _value)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

from moe_triton import ExpertWeights, fused_experts  # noqa: E402
from moe_triton.graphs import capture_graph, capture_mode  # noqa: E402
from moe_triton.parallel import (  # noqa: E402
    ParallelSpec,
    TokenDispatch,
    combine,
    combine_gathered,
    compact_slots,
    dispatch,
    dispatch_gathered,
    localize_ids,
    new_parallel_groups,
    parallel_experts,
    post_experts_reduction,
    reduce_partials,
    shard_experts,
    torch_experts,
)
from moe_triton.tools.bench import (  # noqa: E402
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    LayerShape,
    random_experts,
    random_inputs,
)

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B,
          "tiny": LayerShape("tiny", 8, 2, 64, 32)}
MODES = {  # name -> spec for world size W
    "ep-a2a": lambda w: ParallelSpec(ep_size=w),
    "ep-replicated": lambda w: ParallelSpec(ep_size=w, dispatch=TokenDispatch.REPLICATED),
    "tp": lambda w: ParallelSpec(tp_size=w),
}
DECODE, PREFILL = [1, 8, 64, 256], [2048, 8192]


class Clock:
    """Marks on the device timeline (CUDA events) or on the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e-3 for a, b in pairwise(self.marks)]
        return [b - a for a, b in pairwise(self.marks)]


def start_together(device: torch.device) -> Clock:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return Clock(device)


def phases(x, w13, w2, ids, weights, groups, experts, clock: Clock):
    """parallel_experts' steps, one clock mark between each: returns (output, bytes this rank
    sent)."""
    spec, num_local = groups.spec, w13.shape[0]
    clock.mark()
    if spec.all_to_all:
        sent = dispatch(x, ids, weights, num_local, groups.ep)
        clock.mark()
        local_ids, local_weights = compact_slots(sent.topk_ids, sent.topk_weights, num_local)
        y = experts(sent.hidden_states, w13, w2, local_ids, local_weights)  # [Tr, H]
        clock.mark()
        out = combine(y, sent.plan, groups.ep)  # [T, H]
        clock.mark()
        pairs = int((local_ids >= 0).sum())
        # hidden row + int32 ids + float32 weights
        row_bytes = x.shape[1] * x.element_size() + 8 * ids.shape[1]
        sent_bytes = len(sent.plan.send_token) * row_bytes + y.numel() * y.element_size()
    else:
        clock.mark()  # no dispatch
        local_ids = (localize_ids(ids, groups.ep_rank * num_local, num_local) if spec.ep_size > 1
                     else ids)
        local_ids, local_weights = compact_slots(local_ids, weights, num_local)
        out = experts(x, w13, w2, local_ids, local_weights)  # [T, H] partial
        clock.mark()
        clock.mark()  # no combine
        pairs = int(((local_ids >= 0) & (local_ids < num_local)).sum())
        sent_bytes = 0
    reduction = post_experts_reduction(spec)
    out = reduce_partials(out, reduction, groups)
    clock.mark()
    # a ring all-reduce sends 2 (W - 1) / W of the buffer from each rank
    if reduction.over is not None:
        size = dist.get_world_size(groups.group(reduction.over))
        sent_bytes += 2 * (size - 1) * len(x) * x.shape[1] * x.element_size() // size
    return out, sent_bytes, pairs


def median_seconds(step, reps: int, device) -> float:
    times = []
    for _ in range(reps):
        clock = start_together(device)
        clock.mark()
        step()
        clock.mark()
        times.append(clock.intervals()[0])
    return statistics.median(times)


def slowest(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_setup(shape: LayerShape, mode: str, num_tokens: int, full, device, dtype, groups_by_size):
    """This rank's groups, expert shard (w13, w2) and tokens (x, ids, weights) for `mode`."""
    spec = MODES[mode](dist.get_world_size())
    sizes = (spec.ep_size, spec.tp_size)
    if sizes not in groups_by_size:
        groups_by_size[sizes] = new_parallel_groups(spec)
    # groups depend on the sizes only
    groups = dataclasses.replace(groups_by_size[sizes], spec=spec)
    w13, w2 = shard_experts(*full, spec, groups.rank)
    # ALL_TO_ALL: every rank its own tokens; otherwise the ranks share theirs (the same seed)
    seed = 1 + (groups.rank if spec.all_to_all else 0)
    inputs = random_inputs(shape, num_tokens, dtype, device, num_variants=1, seed=seed)
    return groups, w13, w2, inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]


def bench_row(shape: LayerShape, mode: str, num_tokens: int, full, device, dtype, experts,
              reps: int, groups_by_size):
    groups, w13, w2, x, ids, weights = rank_setup(shape, mode, num_tokens, full, device, dtype,
                                                  groups_by_size)
    spec = groups.spec

    for _ in range(3):  # warm-up: Triton compiles, NCCL connects
        phases(x, w13, w2, ids, weights, groups, experts, Clock(device))
    runs = []
    for _ in range(reps):
        clock = start_together(device)
        out, sent_bytes, pairs = phases(x, w13, w2, ids, weights, groups, experts, clock)
        runs.append(clock.intervals())
    per_phase = [statistics.median(r[i] for r in runs) for i in range(4)]
    shard = ExpertWeights(w13, w2)
    # (parallel_experts' local form)
    local = lambda x_, w, i, tw: experts(x_, w.w13, w.w2, i, tw)  # noqa: E731
    total = median_seconds(lambda: parallel_experts(x, shard, ids, weights, groups, experts=local),
                           reps, device)
    single = median_seconds(lambda: experts(x, *full, ids, weights), reps, device)
    reference = parallel_experts(x, shard, ids, weights, groups, experts=local)
    # phases() must not drift
    drift = (out.float() - reference.float()).abs().amax().item() if out.numel() else 0.0
    times = slowest([*per_phase, total, single, drift], device)
    dispatch_s, experts_s, combine_s, reduce_s, total, single, drift = times
    comm = dispatch_s + combine_s + reduce_s
    flops = 2 * pairs * 3 * shape.hidden_size * (shape.intermediate_size // spec.tp_size)
    us = lambda s, present=True: f"{s * 1e6:.0f}" if present else "-"  # noqa: E731
    reduces = post_experts_reduction(spec).over is not None
    return {
        "mode": mode, "tokens/rank": num_tokens, "dispatch µs": us(dispatch_s, spec.all_to_all),
        "experts µs": us(experts_s), "combine µs": us(combine_s, spec.all_to_all),
        "reduce µs": us(reduce_s, reduces),
        "comm share": f"{comm / (comm + experts_s):.0%}", "total µs": us(total),
        "1 GPU full µs": us(single),
        "sent MB/rank": f"{sent_bytes / 1e6:.3g}",
        "comm GB/s": f"{sent_bytes / comm / 1e9:.3g}" if comm else "-",
        "experts TFLOP/s": f"{flops / experts_s / 1e12:.3g}",
        "phases vs total, max diff": f"{drift:.1e}",
    }


def captured_seconds(step, reps: int, device) -> float:
    """Median seconds of replaying a CUDA graph of `step()` captured in capture mode (on CPU: the
    eager call in capture mode, a smoke test of the same code path)."""
    with capture_mode():
        step()  # outside the capture: compiles, connects, checks the rows per rank
        if device.type != "cuda":
            return median_seconds(step, reps, device)
        graph = capture_graph(lambda _: step(), 1)
    return median_seconds(graph.replay, reps, device)


def captured_row(shape: LayerShape, num_tokens: int, full, device, dtype, experts, reps: int,
                 groups_by_size):
    """EP (gathered dispatch) and TP layers captured at `num_tokens` per rank, and EP's dispatch +
    combine."""
    world, times = dist.get_world_size(), {}
    local = lambda x_, w, i, tw: experts(x_, w.w13, w.w2, i, tw)  # noqa: E731
    for mode in ("ep-a2a", "tp"):
        groups, w13, w2, x, ids, weights = rank_setup(shape, mode, num_tokens, full, device, dtype,
                                                      groups_by_size)
        shard = ExpertWeights(w13, w2)
        times[mode] = captured_seconds(
            lambda: parallel_experts(x, shard, ids, weights, groups, experts=local), reps, device)
        if groups.spec.all_to_all:
            times["dispatch+combine"] = captured_seconds(
                lambda: combine_gathered(
                    dispatch_gathered(x, ids, weights, groups.ep).hidden_states, groups.ep),
                reps, device)
    ep, tp, comm = slowest([times["ep-a2a"], times["tp"], times["dispatch+combine"]], device)
    row_bytes = shape.hidden_size * torch.finfo(dtype).bits // 8
    return {"tokens/rank": num_tokens, "EP layer µs": f"{ep * 1e6:.0f}",
            "TP layer µs": f"{tp * 1e6:.0f}",
            "EP / TP": f"{ep / tp:.2f}", "EP dispatch + combine µs": f"{comm * 1e6:.0f}",
            "gathered MB/rank":
                f"{(world - 1) * num_tokens * (row_bytes + 8 * shape.top_k) / 1e6:.3g}"}


def markdown(rows: list[dict]) -> list[str]:
    columns = list(rows[0])
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows])


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b" if cuda else "tiny")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tokens",
                        default=",".join(map(str, DECODE + PREFILL if cuda
                                             else [1, 8, 64])),
                        help="tokens per rank")
    parser.add_argument("--reps", type=int, default=20 if cuda else 3)
    parser.add_argument("--out", default=None, help="also write the markdown tables here (rank 0)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the captured decode layers (EP gathered vs TP) "
                             "at tokens <= 256")
    args = parser.parse_args()

    if cuda:  # torchrun sets LOCAL_RANK: one GPU per process
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    reference_experts = lambda x, w13, w2, i, tw: torch_experts(  # noqa: E731
        x, ExpertWeights(w13, w2), i, tw)
    dtype, experts = (torch.bfloat16, fused_experts) if cuda else (torch.float32, reference_experts)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups_by_size = {}
    machine = torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"
    lines = [f"world size {world}, {machine}, torch {torch.__version__}"
             + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if cuda else "")
             + f", {dtype}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}"]
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        full = random_experts(shape, dtype, device)
        rows = []
        for mode in args.modes.split(","):
            for num_tokens in map(int, args.tokens.split(",")):
                rows.append(bench_row(shape, mode, num_tokens, full, device, dtype, experts,
                                      args.reps, groups_by_size))
                if rank == 0:
                    print(rows[-1], flush=True)
        lines += ["", f"### {shape.name} (E={shape.num_experts}, K={shape.top_k}, "
                      f"H={shape.hidden_size}, I={shape.intermediate_size}) over {world} ranks",
                  ""] + markdown(rows)
        decode = [n for n in map(int, args.tokens.split(",")) if n <= max(DECODE)]
        if args.graphs and decode:
            rows = [captured_row(shape, n, full, device, dtype, experts, args.reps, groups_by_size)
                    for n in decode]
            how = "CUDA-graph replays" if cuda else "eager calls in capture mode (no CUDA)"
            lines += ["", f"#### {shape.name}, captured decode: {how}", ""] + markdown(rows)
        del full
    if rank == 0:
        text = "\n".join(lines)
        print("\n" + text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
