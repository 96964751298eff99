"""Where the time goes, per grid case: stage times from a GPU run beside the work each stage does.

Reads the pytest-benchmark JSON that benchmarks/test_grid.py wrote on the GPU (its extra_info
holds each case's stage times, graph time, floor and launch configuration) and, on the CPU,
rebuilds a routing of the same kind (softmax top-k of random logits) to count what the layout
makes each stage do: rows including block padding, experts hit, bytes and FLOPs.

    python benchmarks/grid_analysis.py docs/grid/grid-8e63f5b.json > where-the-time-goes.md

Bytes per stage are what the design must move (weights of the experts hit once, activations
in and out), not hardware counters; rates are those bytes or FLOPs over the measured stage time.
"""
import json
import re
import sys

import torch


def layout_rows(num_tokens: int, num_experts: int, top_k: int, block_m: int, per_pair: bool,
                seed: int = 1):
    """(rows computed incl. padding, experts hit) for one routing like the benchmark's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    ids = logits.softmax(dim=-1).topk(top_k, dim=-1).indices.flatten()
    counts = torch.bincount(ids, minlength=num_experts)
    hit = int((counts > 0).sum())
    if per_pair:
        return ids.numel() * block_m, hit
    return (int((torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m).sum()),
            hit)


def analyse(case: dict, bandwidth: float, flops_rate: float) -> dict:
    info = case["extra_info"]
    T, E, K, H, I = (info[k] for k in ("num_tokens", "num_experts", "top_k", "hidden_size",
                                       "intermediate_size"))
    config = info["config"]
    block_m = int(re.search(r"BM(\d+)", config).group(1))
    down_split = int(m.group(1)) if (m := re.search(r"down \S*/K(\d+)", config)) else 1
    R, hit = layout_rows(T, E, K, block_m, config.startswith("per_pair"))
    P = T * K
    rows = R if not config.startswith("per_pair") else P
    y_bytes = P * H * (4 * down_split if down_split > 1 else 2)
    up_bytes = hit * 2 * H * I * 2 + P * H * 2 + P * I * 2
    down_bytes = hit * H * I * 2 + P * I * 2 + y_bytes
    finalize_bytes = y_bytes + T * H * 2
    up_flops, down_flops = 2 * rows * H * 2 * I, 2 * rows * I * H
    stage = {k: info["stage_s"].get(k, 0.0) for k in ("expand", "up", "down", "finalize")}
    kernels = sum(stage.values())

    def floor(bytes_moved, flops):
        return max(bytes_moved / bandwidth, flops / flops_rate)

    return dict(
        shape=info["shape"], M=T, frac=f"{info['roofline_fraction']:.2f}",
        rows=f"{P} -> {rows} ({(rows / P - 1) * 100:.0f}% pad)" if rows != P else f"{P}",
        hit=hit,
        up=f"{stage['up'] * 1e6:.1f} us: {up_bytes / stage['up'] / 1e12:.2f} TB/s, "
           f"{up_flops / stage['up'] / 1e12:.0f} TF/s "
           f"({floor(up_bytes, 2 * P * H * 2 * I) / stage['up']:.2f})",
        down=f"{stage['down'] * 1e6:.1f} us: {down_bytes / stage['down'] / 1e12:.2f} TB/s, "
             f"{down_flops / stage['down'] / 1e12:.0f} TF/s "
             f"({floor(down_bytes, 2 * P * I * H) / stage['down']:.2f})",
        expand_finalize=f"{(stage['expand'] + stage['finalize']) * 1e6:.1f} us "
                        f"({(stage['expand'] + stage['finalize']) / info['graph_s'] * 100:.0f}%)",
        finalize_floor=f"{floor(finalize_bytes, 0) * 1e6:.1f} us",
        launch_gaps=f"{(info['graph_s'] - kernels) * 1e6:.1f} us",
        host_overhead=(f"{(info['ours_s'] - info['graph_s']) * 1e6:.0f} us"
                       if info["timing"] == "eager" else "-"),
    )


def main(path: str) -> None:
    run = json.load(open(path))
    cases = run["benchmarks"]
    # B and F of the run: floor_s = max(bytes / B, flops / F) per case; recover them from two cases
    # is fragile, so take them from the table the run wrote beside the JSON when present.
    table = path.replace(".json", ".md")
    text = open(table).read()
    bandwidth = float(re.search(r"B = ([\d.]+) TB/s", text).group(1)) * 1e12
    flops_rate = float(re.search(r"F = ([\d.]+) TFLOP/s", text).group(1)) * 1e12
    rows = [analyse(case, bandwidth, flops_rate) for case in cases]
    order = {name: i for i, name in enumerate(dict.fromkeys(r["shape"] for r in rows))}
    rows.sort(key=lambda r: (order[r["shape"]], r["M"]))
    columns = list(rows[0])
    print(f"B = {bandwidth / 1e12:.2f} TB/s, F = {flops_rate / 1e12:.0f} TFLOP/s (from {table})\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in columns) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
