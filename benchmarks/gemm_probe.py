"""The expert GEMMs' prefill designs on the H200 (issue 27), one run: each GEMM of the layer timed
alone (do_bench medians, L2 flushed) in choose_config's form and in the persistent / TMA / warp-
specialized / expert-ordered forms, each output checked against choose_config's form; then the
SASS of every compiled variant (matrix and copy instructions, registers, stack) and what this
Triton's `tl.range` offers.

"expert-ordered" times the up GEMM on activations already gathered into the layout's row order
(gather=False, `a` through TMA), and the gather itself (torch's index_select: an upper bound of a
fused pass), to decide whether a gather pass pays for the TMA path.

`--layer` instead times the whole layer (graph replays, stage times from the profiler) per tile
variant, its output against the float32 reference, beside the floor.

    python benchmarks/gemm_probe.py --out probe.md --sass-dir sass/
    python benchmarks/gemm_probe.py --layer --out layer.md --sass-dir sass/
"""
import argparse
import inspect
import os
import re
import subprocess
import sys
from dataclasses import replace

import torch
import triton
import triton.language as tl
from measure import stage_times
from triton.testing import do_bench

from moe_triton import ExpertWeights, WeightFormat, fused_experts_torch, run_experts
from moe_triton.activation import SILU_AND_MUL
from moe_triton.config import choose_config
from moe_triton.expert_gemm import Fp8Scales, plan_expert_gemm
from moe_triton.graphs import capture_graph
from moe_triton.pipeline import _plan, _plan_quantize
from moe_triton.platform import device_limits
from moe_triton.tools.bench import (
    GRID_SHAPES,
    floor_seconds,
    layer_bytes,
    layer_flops,
    measure_ceilings,
    random_experts,
    random_inputs,
    time_graph_replays,
)

CASES = [(name, 4096) for name in GRID_SHAPES] + [("Qwen3-30B-A3B", 1024),
                                                   ("Qwen3-30B-A3B", 16384)]
FORMATS = {"bf16": None, "fp8-block": WeightFormat.fp8_block(128, 128)}
SASS_OPS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDL", "STL")
_sass_seen: dict[tuple, str] = {}


def gemm_variants(gemm, num_sms: int, up: bool) -> dict:
    """name -> (GemmConfig, expert-ordered a): choose_config's, then the other designs."""
    p = replace(gemm, persistent_programs=num_sms)
    out = {"base": (gemm, False), "persistent": (p, False)}
    if gemm.block_c > 32:
        out["base c/2"] = (replace(gemm, block_c=gemm.block_c // 2), False)
    if up:
        ordered = replace(gemm, tma_activations=True)
        out |= {"ordered": (ordered, True),
                "ordered+persistent": (replace(ordered, persistent_programs=num_sms), True)}
    else:
        out |= {"tma_a": (replace(gemm, tma_activations=True), False),
                "tma_a+persistent": (replace(p, tma_activations=True), False)}
        if gemm.block_n > 128:
            out["tma_a+persistent n/2"] = (replace(p, tma_activations=True,
                                                   block_n=gemm.block_n // 2), False)
    return out


def sass_summary(launch, path: str) -> str:
    compiled = launch._compiled
    cubin = compiled.asm["cubin"]
    key = (len(cubin), hash(cubin))
    if key in _sass_seen:
        return _sass_seen[key]
    with open(path + ".cubin", "wb") as f:
        f.write(cubin)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    sass = subprocess.run([cuobjdump, "--dump-sass", path + ".cubin"], capture_output=True,
                          text=True).stdout
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path + ".cubin"],
                           capture_output=True, text=True).stdout
    with open(path + ".sass", "w") as f:
        f.write(sass)
    counts = " ".join(f"{op}={len(re.findall(rf'{op}[ .]', sass))}" for op in SASS_OPS)
    resources = " ".join(re.findall(r"(?:REG|STACK):\d+", usage))
    _sass_seen[key] = f"{counts} {resources} smem={compiled.metadata.shared}"
    return _sass_seen[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sass-dir", required=True)
    parser.add_argument("--cases", type=int, default=len(CASES))
    parser.add_argument("--layer", action="store_true")
    args = parser.parse_args()
    if args.layer:
        return layer_main(args)
    os.makedirs(args.sass_dir, exist_ok=True)
    device = torch.device("cuda")
    num_sms = device_limits(device)[0]
    ceilings = measure_ceilings(device)
    lines = [f"# Expert GEMM prefill designs: {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, triton {triton.__version__}", "",
             f"B = {ceilings.bandwidth / 1e12:.2f} TB/s, F = {ceilings.matmul_flops / 1e12:.0f}, "
             f"F8 = {ceilings.fp8_matmul_flops / 1e12:.0f} TFLOP/s, {num_sms} SMs", "",
             f"tl.range{inspect.signature(tl.range.__init__)}", "",
             "| shape | format | M | gemm | variant | us | TFLOP/s | of F(8) | max diff vs base | "
             "tile | SASS |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    report = open(args.out, "w")  # written as it goes: a run cut short keeps its rows

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        report.write(line + "\n")
        report.flush()

    for line in lines:
        print(line, flush=True)
        report.write(line + "\n")
    for name, num_tokens in CASES[:args.cases]:
        shape = GRID_SHAPES[name]
        K, H, I = shape.top_k, shape.hidden_size, shape.intermediate_size
        native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
        inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", 1)
        x, ids, topk_weights = inputs.hidden_states[0], inputs.topk_ids[0], inputs.topk_weights[0]
        for fmt_name, fmt in FORMATS.items():
            weights = native if fmt is None else native.to_format(fmt)
            ceiling = ceilings.matmul_flops if fmt is None else ceilings.fp8_matmul_flops
            layer = _plan(x, weights, ids, topk_weights, SILU_AND_MUL, None, None)
            layout = layer.expand(ids)
            xq, xq_scales = (x, None) if layer.quantize is None else layer.quantize(x)
            rows = layout.sorted_pair_ids.long()
            rows_used = int(layout.num_rows.item())
            # rows past those in use hold whatever the buffer held
            real = (torch.arange(rows.numel(), device=device) < rows_used) & (
                rows < layout.num_pairs) & (rows >= 0)
            # the up GEMM's rows in layout order (padding rows: zeros)
            token = torch.where(real, rows // K, 0)
            ordered = xq[token]  # padding rows: token 0's (their outputs are never stored)
            ordered_scales = None if xq_scales is None else xq_scales[token]
            gather_us = do_bench(lambda token=token, xq=xq: xq.index_select(0, token),
                                 return_mode="median") * 1e3
            emit(f"| {name} | {fmt_name} | {num_tokens} | gather | index_select | "
                 f"{gather_us:.1f} | | | | | |")
            h, h_scales = layer.up(xq, weights.w13, layout, xq_scales, weights.w13_scale)
            base_out = {}
            for gemm_name, base in (("up", layer.up), ("down", layer.down)):
                flops = 2 * rows_used * (2 * I * H if gemm_name == "up" else H * I)
                for variant, (config, expert_ordered) in gemm_variants(
                        base.config, num_sms, gemm_name == "up").items():
                    try:
                        if gemm_name == "up":
                            a, a_scales = (ordered, ordered_scales) if expert_ordered else (
                                xq, xq_scales)
                            plan = plan_expert_gemm(
                                a, weights.w13, layout, config, gather=not expert_ordered,
                                activation=SILU_AND_MUL, scales=_up_scales(x, weights, a_scales),
                                out_dtype=base.out_dtype)
                            call = lambda plan=plan, a=a, s=a_scales: plan(  # noqa: E731
                                a, weights.w13, layout, s, weights.w13_scale)
                        else:
                            plan = plan_expert_gemm(h, weights.w2, layout, config, gather=False,
                                                    scales=_down_scales(weights, h_scales,
                                                                        layer.up.config),
                                                    out_dtype=base.out_dtype)
                            call = lambda plan=plan: plan(  # noqa: E731
                                h, weights.w2, layout, h_scales, weights.w2_scale)
                        out = call()[0]
                        used = out[real].float()
                        if variant == "base":
                            base_out[gemm_name] = used
                        diff = (used - base_out[gemm_name]).abs().max().item()
                        us = do_bench(call, return_mode="median") * 1e3
                        sass = sass_summary(plan.launch, os.path.join(
                            args.sass_dir, re.sub(r"[^\w+-]", "_",
                                                  f"{name}-{fmt_name}-{gemm_name}-{variant}")))
                    except Exception as error:  # a variant this Triton cannot build: say so
                        torch.cuda.synchronize()
                        text = str(error).strip().splitlines()
                        emit(f"| {name} | {fmt_name} | {num_tokens} | {gemm_name} | {variant} | "
                             f"failed: {type(error).__name__}: {(text[0] if text else '')[:200]} "
                             "| | | | | |")
                        continue
                    tflops = flops / us / 1e6
                    c = config
                    tile = (f"BM{c.block_m} {c.block_n}x{c.block_c}/s{c.num_stages}/w{c.num_warps}"
                            f"{' P' if c.persistent_programs else ''}")
                    emit(f"| {name} | {fmt_name} | {num_tokens} | {gemm_name} | {variant} "
                         f"| {us:.1f} | {tflops:.0f} | {tflops * 1e12 / ceiling:.2f} | "
                         f"{diff:.3g} | {tile} | {sass} |")
            torch.cuda.empty_cache()
    report.close()


def tile_variants(base, fp8: bool) -> dict:
    """name -> MoEConfig: choose_config's tiles and the alternatives weighed last (the earlier
    sets and their results: docs/grid/issue27-layer-*)."""
    out = {"base": base}
    if fp8:
        # 128-row FP8 tiles: two warpgroups along the rows, each MMA 64 x 128 x 32 (64-row tiles
        # on 8 warps split the columns: 64 x 64 x 32); they spilled before the per-tile scale
        def rows(c, **kw):
            return replace(c, block_m=128, **kw)
        out["BM128"] = replace(base, up=rows(base.up), down=rows(base.down))
        out["BM128 down w8"] = replace(base, up=rows(base.up), down=rows(base.down, num_warps=8))
        out["BM128 up s3"] = replace(base, up=rows(base.up, num_stages=3), down=rows(base.down))
    return out


def layer_main(args) -> None:
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    formats = {**FORMATS, "fp8-channel": WeightFormat.fp8_channel()}
    report = open(args.out, "w")

    def emit(line: str) -> None:
        print(line, flush=True)
        report.write(line + "\n")
        report.flush()

    emit(f"# Layer tile variants: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"triton {triton.__version__}\n\nB = {ceilings.bandwidth / 1e12:.2f} TB/s, F = "
         f"{ceilings.matmul_flops / 1e12:.0f}, F8 = {ceilings.fp8_matmul_flops / 1e12:.0f} "
         "TFLOP/s\n\n| shape | format | M | variant | layer_us | of floor | up_us | down_us | "
         "expand_us | finalize_us | other_us | rel_err | tiles |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, num_tokens in CASES[:args.cases]:
        shape = GRID_SHAPES[name]
        native = ExpertWeights(*random_experts(shape, torch.bfloat16, "cuda"))
        inputs = random_inputs(shape, num_tokens, torch.bfloat16, "cuda", LAYER_VARIANTS)
        reference = fused_experts_torch(inputs.hidden_states[0].float(), native.w13.float(),
                                        native.w2.float(), inputs.topk_ids[0],
                                        inputs.topk_weights[0])
        for fmt_name, fmt in formats.items():
            if fmt_name == "fp8-channel" and name != "Qwen3-30B-A3B":
                continue
            weights = native if fmt is None else native.to_format(fmt)
            fp8 = fmt is not None
            base = choose_config(num_tokens, shape.top_k, shape.num_experts, shape.hidden_size,
                                 shape.intermediate_size, device, weights.dtype)
            floor = floor_seconds(layer_bytes(shape, inputs.topk_ids[0], 1 if fp8 else 2),
                                  layer_flops(shape, num_tokens), ceilings, fp8)
            for variant, config in tile_variants(base, fp8).items():
                def step(i, weights=weights, config=config):
                    return run_experts(inputs.hidden_states[i], weights, inputs.topk_ids[i],
                                       inputs.topk_weights[i], config=config)
                try:
                    out = step(0).float()
                    rel = ((out - reference).norm() / reference.norm()).item()
                    layer_s = time_graph_replays(capture_graph(step, LAYER_VARIANTS),
                                                 LAYER_VARIANTS)
                    stages = stage_times(step, LAYER_VARIANTS)
                except Exception as error:  # a variant this Triton cannot build: say so
                    torch.cuda.synchronize()
                    text = str(error).strip().splitlines()
                    emit(f"| {name} | {fmt_name} | {num_tokens} | {variant} | failed: "
                         f"{type(error).__name__}: {(text[0] if text else '')[:200]} |")
                    continue
                us = {k: stages.get(k, 0) * 1e6 for k in ("up", "down", "expand", "finalize",
                                                           "other")}
                emit(f"| {name} | {fmt_name} | {num_tokens} | {variant} | {layer_s * 1e6:.1f} | "
                     f"{floor / layer_s:.2f} | {us['up']:.1f} | {us['down']:.1f} | "
                     f"{us['expand']:.1f} | {us['finalize']:.1f} | {us['other']:.1f} | "
                     f"{rel:.4f} | {config.describe()} |")
            torch.cuda.empty_cache()
    report.close()


LAYER_VARIANTS = 4


def _up_scales(x, weights, a_scales):
    """The up GEMM's FP8 scales as pipeline plans them, over this variant's activation scales."""
    if a_scales is None:
        return None
    return replace(_plan_quantize(x, weights)[2], a=a_scales)


def _down_scales(weights, h_scales, up_config):
    if h_scales is None:
        return None
    return Fp8Scales(h_scales, up_config.block_n, weights.w2_scale, weights.format.block)


if __name__ == "__main__":
    sys.exit(main())
