"""`moe-triton bench | resolve | probe | demo`: the command line; environment is read here only.
Without CUDA (or with --cpu) it restarts itself under TRITON_INTERPRET=1 when unset. Every refusal
is one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def _bench_cases(on_gpu: bool):
    from .bench import QWEN3_30B_A3B, LayerShape

    if on_gpu:
        return QWEN3_30B_A3B, [1, 8, 32, 128, 2048]
    return LayerShape("tiny (E=8, K=2, H=128, I=96)", 8, 2, 128, 96), [1, 8, 32]


def _restart_with_interpreter(argv: list[str]) -> None:
    """Kernels are bound to the interpreter when defined, i.e. at import: start again with it on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    os.execve(sys.executable, [sys.executable, "-m", "moe_triton.tools.cli", *argv], env)


def _runs_on_cpu(args) -> bool:
    return not torch.cuda.is_available() or getattr(args, "cpu", False)


def bench(args) -> int:
    from tqdm import tqdm

    from ..pipeline import fused_experts
    from .bench import (
        capture_graph,
        floor_seconds,
        layer_bytes,
        layer_flops,
        measure_ceilings,
        random_experts,
        random_inputs,
        time_cpu,
        time_eager,
        time_graph_replays,
    )
    on_gpu = not _runs_on_cpu(args)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16  # the interpreter's bf16 dot is wrong
    shape, tokens = _bench_cases(on_gpu)
    tokens = args.tokens or tokens
    where = (torch.cuda.get_device_name() if on_gpu
             else "CPU, Triton interpreter (correctness path, NOT a performance number)")
    print(f"moe-triton bench: {shape.name} E={shape.num_experts} K={shape.top_k} "
          f"H={shape.hidden_size} I={shape.intermediate_size}, {dtype}, on {where}")
    ceilings = measure_ceilings(device) if on_gpu else None
    w13, w2 = random_experts(shape, dtype, device)
    rows = []
    for T in tqdm(tokens, desc="timing", unit="case"):
        inputs = random_inputs(shape, T, dtype, device, num_variants=4)
        step = lambda i, inputs=inputs: fused_experts(  # noqa: E731
            inputs.hidden_states[i], w13, w2, inputs.topk_ids[i], inputs.topk_weights[i])
        if not on_gpu:
            rows.append((T, time_cpu(step), None, "wall"))
            continue
        seconds = (time_graph_replays(capture_graph(step, 4), 4) if T <= 256
                   else time_eager(step, 4))
        floor = floor_seconds(sum(layer_bytes(shape, ids) for ids in inputs.topk_ids) / 4,
                              layer_flops(shape, T), ceilings)
        rows.append((T, seconds, floor, "graph" if T <= 256 else "do_bench"))
    if ceilings:
        print(f"ceilings measured now: copy {ceilings.bandwidth / 1e12:.2f} TB/s, "
              f"bf16 matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>8} {'time_us':>12} {'floor_us':>10} {'of floor':>9}  timing")
    for T, seconds, floor, how in rows:
        floor_text = (f"{floor * 1e6:10.1f} {floor / seconds:8.0%}" if floor
                      else f"{'-':>10} {'-':>9}")
        print(f"{T:>8} {seconds * 1e6:12.1f} {floor_text}  {how}")
    return 0


def _read_config(path: Path) -> tuple[dict, Path | None]:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(f"{path} is neither a config.json nor a model directory holding one")
    if config_file.suffix != ".json":
        raise ValueError(f"{path} is not a config.json; "
                         f"pass the model directory ({path.parent}) or its config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    return config, config_file.parent


def resolve_backend(args) -> int:
    from .. import platform as platforms
    from ..quant_config import config_group_formats
    from ..runners import ModelContext, resolve

    try:
        config, model_dir = _read_config(Path(args.model))
        platform = args.platform or platforms.detect_platform()
        context = ModelContext.from_config(config, model_dir, all_to_all=args.all_to_all,
                                           lora=args.lora)
        resolution = resolve(args.backend, platform, context)
        layers, not_built = _layer_resolutions(model_dir, args, platform, context)
    except ValueError as error:
        print(f"moe-triton resolve: {error}", file=sys.stderr)
        return 2
    if args.platform:
        where = f"{platform} (named" + (f"; FlashInfer {platform.flashinfer} assumed)"
                                        if platform.flashinfer else ")")
    else:
        where = f"{platform} (this machine; FlashInfer {platform.flashinfer or 'not installed'})"
    print(f"model:         {context.architecture} ({args.model})")
    print(f"quantization:  {context.quantization.experts}")
    for group, detail in config_group_formats(context.quant_config):
        print(f"  {group}: {detail}")
    print(f"experts held:  {_experts_format(context)}")
    print(f"platform:      {where}")
    print(f"all-to-all:    {context.all_to_all or 'none'}   "
          f"LoRA: {'on' if context.lora else 'off'}")
    if layers:
        dtype = str(layers[0][1]).removeprefix("torch.")
        print(f"layers:        {len(layers)} MoE layers, resolved as load_model builds them "
              f"({dtype})")
        resolution = layers[0][0]
    else:
        print(f"layers:        not built ({not_built}): resolved without the layers' dtype and "
              "weight format")
    print(f"requested:     {resolution.requested}")
    print(f"backend:       {resolution.backend}")
    print(f"rule:          {resolution.rule}")
    print(f"reason:        {resolution.reason}")
    for other in dict.fromkeys(r for r, _ in layers[1:] if r != resolution):
        print(f"  another layer: {other}")
    return 0


def _layer_resolutions(model_dir: Path, args, platform, context) -> tuple[list, str | None]:
    """([(resolution, dtype)] of each MoE layer as load_model builds it on `platform`, why not)."""
    import dataclasses
    import warnings

    from ..models.registry import layer_resolutions, plan_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        plan = plan_model(model_dir, dtype)  # what load_model reads before building
    except ValueError as error:
        return [], str(error)
    plan = dataclasses.replace(plan, context=context)  # with --all-to-all and --lora
    with warnings.catch_warnings():  # load_model's fallback warning: the backend line says it
        warnings.simplefilter("ignore")
        resolutions = layer_resolutions(plan, args.backend, platform)  # may refuse, as load_model
    return [(r, plan.dtype) for r in resolutions], None if resolutions else "no MoE layers"


def _experts_format(context) -> str:
    try:
        return f"{context.experts_format()} (load_model)"
    except ValueError as error:
        return f"not loadable: {error}"


def probe_backends(args) -> int:
    from .probe import ProbeCase, ProbeMismatch, build_case, probe

    on_gpu = not _runs_on_cpu(args)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter's bf16 dot is wrong
    case = ProbeCase(num_tokens=args.tokens)
    try:
        layer_a, hidden_states, lm_head = build_case(case, args.backends[0], dtype, device,
                                                     seed=args.seed)
        layer_b, _, _ = build_case(case, args.backends[1], dtype, device, seed=args.seed)
    except (ValueError, ImportError) as error:
        print(f"moe-triton probe: {error}", file=sys.stderr)
        return 2
    print(f"moe-triton probe: E={case.num_experts} K={case.top_k} H={case.hidden_size} "
          f"I={case.intermediate_size} T={case.num_tokens}, {dtype}")
    for layer in (layer_a, layer_b):
        print(f"  {layer.resolution}")
    try:
        report = probe(layer_a, layer_b, hidden_states, lm_head=lm_head,
                       tolerance=args.tolerance, min_token_agreement=args.min_agreement)
    except ProbeMismatch as mismatch:
        print(mismatch.report)
        return 1
    print(report)
    return 0


def demo(args) -> int:
    from .demo import DemoOptions, run_demo

    if args.model is not None and not (args.model / "config.json").exists():
        print(f"moe-triton demo: {args.model} is not a checkpoint directory (no config.json)",
              file=sys.stderr)
        return 2
    try:
        options = DemoOptions(model=args.model, backend=args.backend, batch=args.batch,
                              tokens=args.tokens, graphs=not args.no_graphs,
                              overlap=not args.no_overlap, quant=args.quant)
        return run_demo(options)
    except Exception as error:  # one clear line for users; the traceback on request
        if args.debug:
            raise
        print(f"moe-triton demo: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _number(cast, accepts, expected: str):
    """An argparse type: `cast(text)` when `accepts` it, else a one-line error."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):  # NaN fails every comparison: refused too
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_tolerance = _number(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
_fraction = _number(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")


def _platform(text: str):
    from .. import platform as platforms

    try:
        return platforms.named_platform(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    from .. import platform as platforms

    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help (0) or a usage error, already reported in one line (2)
        return exit.code or 0
    if _runs_on_cpu(args) and not platforms.interpreter_enabled():
        _restart_with_interpreter(argv)
    return args.run(args)


def _parser() -> _Parser:
    from ..runners.spec import ExpertBackend

    parser = _Parser(prog="moe-triton", description="Triton MoE expert layer tools")
    commands = parser.add_subparsers(dest="command", required=True)
    backends = ["auto", *(backend.value for backend in ExpertBackend)]
    _add_demo(commands, backends)
    _add_bench(commands)
    _add_resolve(commands, backends)
    _add_probe(commands, backends)
    return parser


def _add_demo(commands, backends: list[str]) -> None:
    demo_parser = commands.add_parser(
        "demo", help="generate with a small MoE model and check it against transformers")
    demo_parser.add_argument("--model", type=Path,
                             help="a local checkpoint directory (default: a built-in tiny model)")
    demo_parser.add_argument("--backend", default="auto", choices=backends)
    demo_parser.add_argument("--batch", type=_positive_int, default=2)
    demo_parser.add_argument("--tokens", type=_positive_int, default=16,
                             help="new tokens per sequence")
    demo_parser.add_argument("--no-graphs", action="store_true",
                             help="decode eagerly, without CUDA graphs")
    demo_parser.add_argument("--no-overlap", action="store_true",
                             help="no alternate streams in captured decode")
    demo_parser.add_argument("--quant", choices=["fp8"],
                             help="the built-in model as an FP8 checkpoint (block-scaled), "
                                  "experts on the FP8 kernels")
    demo_parser.add_argument("--debug", action="store_true", help="show tracebacks")
    demo_parser.set_defaults(run=demo)


def _add_bench(commands) -> None:
    bench_parser = commands.add_parser("bench", help="time the expert layer on a built-in shape")
    bench_parser.add_argument("--tokens", type=_positive_int, nargs="+",
                              help="token counts to time")
    bench_parser.add_argument("--cpu", action="store_true",
                              help="use the CPU interpreter even if a GPU is present")
    bench_parser.set_defaults(run=bench)


def _add_resolve(commands, backends: list[str]) -> None:
    from ..runners.spec import ALL_TO_ALL_BACKENDS

    resolve_parser = commands.add_parser("resolve",
                                         help="which expert backend a model gets here, and why")
    resolve_parser.add_argument("model", help="a config.json or a model directory holding one")
    resolve_parser.add_argument("--platform", type=_platform,
                                help="resolve for a named platform: "
                                     "cpu, sm90, sm100, sm103, sm110, sm120")
    resolve_parser.add_argument("--backend", default="auto", choices=backends)
    resolve_parser.add_argument("--all-to-all", dest="all_to_all", choices=ALL_TO_ALL_BACKENDS,
                                help="the serving engine's expert-parallel all-to-all backend, "
                                     "e.g. deepep")
    resolve_parser.add_argument("--lora", action="store_true", help="LoRA adapters on the experts")
    resolve_parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                                help="load_model's dtype (default: config.json's, as load_model)")
    resolve_parser.set_defaults(run=resolve_backend)


def _add_probe(commands, backends: list[str]) -> None:
    probe_parser = commands.add_parser(
        "probe", help="run a small layer on two backends and compare (temperature 0)")
    probe_parser.add_argument("backends", nargs=2, choices=backends, metavar="BACKEND",
                              help=f"two of {', '.join(backends)} (e.g. torch triton)")
    probe_parser.add_argument("--tokens", type=_positive_int, default=16)
    probe_parser.add_argument("--tolerance", type=_tolerance,
                              help="max relative difference (default by dtype)")
    probe_parser.add_argument("--min-agreement", dest="min_agreement", type=_fraction, default=1.0,
                              help="minimum fraction of equal greedy tokens")
    probe_parser.add_argument("--seed", type=int, default=0)
    probe_parser.add_argument("--cpu", action="store_true",
                              help="use the CPU interpreter even if a GPU is present")
    probe_parser.set_defaults(run=probe_backends)


if __name__ == "__main__":
    raise SystemExit(main())
