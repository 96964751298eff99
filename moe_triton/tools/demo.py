"""`moe-triton demo`: a tiny Cohere2-MoE (RANDOM weights, built once) loaded through models/ and
checked against transformers' tokens; `--quant fp8` writes it block-scaled for the FP8 kernels,
whose logits must stay within FP8_LOGITS_TOL (FP8 rounds activations: tokens are reported)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEMO_NAME = "cohere2-moe-tiny-random-v2"
FP8_DEMO_NAME = "cohere2-moe-tiny-random-fp8-v1"
FP8_BLOCK = (16, 16)  # divides the sizes (64, 48, 32), as transformers' dequantizer needs
# Two e4m3 activation roundings (layer input, intermediate), each <= 2^-4 relative, RMS 0.036:
# 0.05 relative on the experts' output bounds the logits (tests/test_models_fp8.py).
FP8_LOGITS_TOL = 0.05


@dataclass(frozen=True)
class DemoOptions:
    model: Path | None = None  # a local checkpoint directory; None: the built-in one
    backend: str = "auto"
    batch: int = 2
    tokens: int = 16
    graphs: bool = True
    overlap: bool = True
    prompt_length: int = 8
    quant: str | None = None  # "fp8": the built-in model as an FP8 checkpoint

    def __post_init__(self):
        if self.quant not in (None, "fp8"):
            raise ValueError(f"DemoOptions.quant must be None or 'fp8', got {self.quant!r}")
        if self.quant is not None and self.model is not None:
            raise ValueError("--quant fp8 builds the built-in model in FP8; "
                             "a --model checkpoint runs in its own format")
        for name in ("batch", "tokens", "prompt_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DemoOptions.{name} must be an integer >= 1, got {value!r}")


def cache_dir(name: str = DEMO_NAME) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "moe-triton" / name


def cached_checkpoint(path: Path, write) -> Path:
    """`path`, written once by `write` into a temporary directory renamed when whole (Ctrl-C)."""
    if path.exists():
        if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
            raise ValueError(f"the demo's cached checkpoint {path} is incomplete "
                             "(an interrupted build?): "
                             f"remove it (rm -rf {path}) and run again")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(staging)
        try:
            staging.rename(path)
        except OSError:  # another demo built it meanwhile
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def build_demo_checkpoint(path: Path) -> Path:
    return cached_checkpoint(path, _write_demo_checkpoint)


def _write_demo_checkpoint(path: Path) -> None:
    from tqdm import tqdm
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    with tqdm(total=3, desc="building the demo checkpoint (random weights)", unit="step") as bar:
        config = Cohere2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  num_shared_experts=1, sliding_window=64,
                                  layer_types=["sliding_attention", "full_attention"],
                                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
        torch.manual_seed(0)
        model = Cohere2MoeForCausalLM(config)
        bar.update()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 1.0 if "embed" in name or "lm_head" in name else 0.15)
        bar.update()
        model.save_pretrained(path)
        bar.update()


def build_fp8_demo_checkpoint(path: Path, source: Path) -> Path:
    """`source` with each linear in e4m3 beside its block `weight_scale_inv` (router, head kept)."""
    return cached_checkpoint(path,
                             lambda staging: _write_fp8_demo_checkpoint(staging, source))


def _write_fp8_demo_checkpoint(path: Path, source: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    from ..weights import WeightFormat, quantize_weight

    fmt = WeightFormat.fp8_block(*FP8_BLOCK)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith("_proj.weight"):  # q/k/v/o, shared and routed experts' gate/up/down
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = (
                quantize_weight(tensor, fmt))
        else:
            tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK),
                                     "modules_to_not_convert": ["gate", "lm_head"]}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def resolution_line(resolution, weight_format=None) -> str:
    """The experts' backend (saying so when auto fell back to torch) and their weights' format."""
    line = f"experts backend: {resolution}"
    if resolution.torch_fallback:
        line += ("\n  (fallback: the Triton kernels do not run here; "
                 "the torch reference computes the experts)")
    if weight_format is not None:
        line += f"\nexperts format: {weight_format} (on {resolution.backend})"
    return line


def _reference(path: Path, dtype, device):
    """transformers on the checkpoint; FP8 and MXFP4 dequantized (their kernels come from the Hub
    at run time, which an offline machine cannot reach)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    extra = {}
    method = _checkpoint_method(path)
    if method == "fp8":
        extra["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    elif method == "mxfp4":
        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).to(device).eval()


def _checkpoint_method(path: Path) -> str | None:
    from ..runners import ModelContext

    return ModelContext.from_config(json_config(path), path).quantization.checkpoint_format().method


def _is_fp8_checkpoint(path: Path) -> bool:
    return _checkpoint_method(path) == "fp8"


def check_reference_packages(options: DemoOptions) -> None:
    # transformers' FP8 quantizer needs accelerate: say so before step 1, not minutes later at 4
    fp8 = options.quant == "fp8"
    if options.model is not None:
        try:
            fp8 = _is_fp8_checkpoint(options.model)
        except Exception:  # a config that cannot be read: load_model, in step 1, says what is wrong
            fp8 = False
    if fp8 and importlib.util.find_spec("accelerate") is None:
        raise ValueError("the FP8 demo's reference (transformers on the dequantized checkpoint) "
                         "needs the package accelerate: pip install accelerate")


def _agreement(ours: torch.Tensor, expected: torch.Tensor) -> float:
    """The fraction of equal new tokens; a longer one's extra tokens (after EOS) disagree."""
    width = max(ours.shape[1], expected.shape[1])
    ours, expected = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1)
                      for t in (ours, expected))
    return (ours == expected).float().mean().item()


def json_config(path: Path) -> dict:
    import json

    return json.loads((path / "config.json").read_text())


def run_demo(options: DemoOptions, print_=print) -> int:
    check_reference_packages(options)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    path, dtype, backend = _demo_inputs(options, on_gpu, print_)
    steps = 5 if on_gpu and options.graphs and options.overlap else 4

    def phase(step: int, text: str) -> None:  # the long steps say what they do (interpreter: slow)
        print_(f"[{step}/{steps}] {text} ...")
        sys.stdout.flush()

    model, fp8_kernels = _load(options, path, dtype, device, backend, on_gpu, phase, print_)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (options.batch, options.prompt_length),
                           generator=g).to(device)
    ours, seconds, prefill_seconds = _generate(options, model, prompt, phase)
    match, error, agree = _check(options, path, model, prompt, ours, fp8_kernels, dtype, device,
                                 phase)
    return _report(options, model, prompt, ours, seconds, prefill_seconds, match, error, agree,
                   fp8_kernels, on_gpu, phase, print_)


def _demo_inputs(options: DemoOptions, on_gpu: bool, print_) -> tuple[Path, torch.dtype, str]:
    from ..platform import interpreter_enabled

    fp8 = options.quant == "fp8"
    path = options.model or build_demo_checkpoint(cache_dir())
    if fp8:
        path = build_fp8_demo_checkpoint(cache_dir(FP8_DEMO_NAME), path)
    # float32 keeps the tiny model's greedy tokens comparable; FP8: bf16 on GPU, fp16 interpreted
    dtype = torch.float32 if options.model is None or not on_gpu else torch.bfloat16
    if fp8:
        dtype = torch.bfloat16 if on_gpu else torch.float16
    backend = "triton" if fp8 and options.backend == "auto" else options.backend
    where = torch.cuda.get_device_name() if on_gpu else (
        "CPU, Triton kernels in the interpreter (slow, a correctness path)"
        if interpreter_enabled() else "CPU")
    built_in = ("  (built-in: RANDOM weights, the tokens mean nothing)" if options.model is None
                else "")
    print_(f"model: {path}{built_in}{'  FP8: experts on the Triton FP8 kernels' if fp8 else ''}")
    print_(f"device: {where}, dtype {str(dtype).removeprefix('torch.')}")
    return path, dtype, backend


def _load(options, path, dtype, device, backend, on_gpu, phase, print_):
    from ..models import load_model

    phase(1, "loading the checkpoint through moe_triton.models")
    model = load_model(path, dtype=dtype, device=device, backend=backend)
    model.use_graphs, model.use_overlap = options.graphs and on_gpu, options.overlap and on_gpu
    layer = next(m for m in model.modules() if hasattr(m, "resolution"))
    print_(resolution_line(layer.resolution, layer.weight_format))
    fp8_kernels = layer.weight_format.fp8 is not None and layer.backend != "torch"
    return model, fp8_kernels


def _generate(options, model, prompt, phase):
    phase(2, f"generating {options.batch} x {options.tokens} tokens (the first run compiles the "
             f"kernels{', captures the decode graphs' if model.use_graphs else ''})")
    model.setup(options.batch, options.prompt_length + options.tokens)
    ours = model.generate(prompt, options.tokens)  # also the warm-up: kernels compile on first use
    phase(3, "timing generate and prefill")
    _, seconds = _timed(lambda: model.generate(prompt, options.tokens))
    _, prefill_seconds = _timed(lambda: model.prefill(prompt))
    return ours, seconds, prefill_seconds


def _check(options, path, model, prompt, ours, fp8_kernels, dtype, device, phase):
    phase(4, "generating the same tokens with transformers, the reference")
    # float32: transformers' dequantizing loader leaves float32 weights beside bf16 activations
    reference = _reference(path, torch.float32 if fp8_kernels else dtype, device)
    expected = reference.generate(prompt, max_new_tokens=options.tokens, do_sample=False)
    match = torch.equal(ours, expected)
    error = agree = None
    if fp8_kernels:
        with torch.no_grad():
            logits, reference_logits = model.prefill(prompt), reference(prompt).logits.float()
        error = ((logits - reference_logits).norm() / reference_logits.norm()).item()
        agree = _agreement(ours[:, options.prompt_length:], expected[:, options.prompt_length:])
    return match, error, agree


def _report(options, model, prompt, ours, seconds, prefill_seconds, match, error, agree,
            fp8_kernels, on_gpu, phase, print_) -> int:
    new_tokens = ours.shape[1] - options.prompt_length  # fewer than asked when all hit EOS
    stopped = ", stopped at EOS" if new_tokens < options.tokens else ""
    shown = f"{options.batch} x {new_tokens} tokens{stopped}"
    rows = [("generate", options.batch * new_tokens / seconds, seconds * 1e3)]
    rows.append(("prefill", options.batch * options.prompt_length / prefill_seconds,
                 prefill_seconds * 1e3))
    if on_gpu and options.graphs and options.overlap:  # the same generation without overlap
        phase(5, "generating again with overlap off")
        model.use_overlap = False
        model.setup(options.batch, options.prompt_length + options.tokens)
        serial_tokens = model.generate(prompt, options.tokens)
        _, serial_seconds = _timed(lambda: model.generate(prompt, options.tokens))
        match = match and torch.equal(serial_tokens, ours)
        serial = options.batch * new_tokens / serial_seconds
        rows.append(("generate, overlap off", serial, serial_seconds * 1e3))
    print_(f"decode: {'CUDA graphs' if model.graphs is not None else 'eager'}, "
           f"overlap {'on' if options.overlap and on_gpu else 'off'}")
    print_(f"{'stage':<24}{'tokens/s':>12}{'ms':>12}")
    for name, rate, ms in rows:
        print_(f"{name:<24}{rate:>12.1f}{ms:>12.2f}")
    if fp8_kernels:
        within = error < FP8_LOGITS_TOL
        print_("prefill logits vs transformers on the dequantized checkpoint: "
               f"relative error {error:.4f} "
               f"(FP8 bound {FP8_LOGITS_TOL}): {'ok' if within else 'TOO LARGE'}")
        print_(f"tokens equal to transformers' generate: {agree:.0%} ({shown}; "
               "FP8's activation rounding may flip a near tie)")
        return 0 if within else 1
    print_(f"tokens match transformers' generate: {'yes' if match else 'NO'} ({shown})")
    return 0 if match else 1
