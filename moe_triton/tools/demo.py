"""`moe-triton demo`: build (once) a small MoE checkpoint, load it through models/, generate,
check the tokens against transformers' own generation, and print what ran where and how fast.

The built-in checkpoint is a narrow Cohere2-MoE (the parallel block, so overlap has something
to overlap) with RANDOM weights: its tokens mean nothing; that they equal transformers' does.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEMO_NAME = "cohere2-moe-tiny-random-v2"


@dataclass(frozen=True)
class DemoOptions:
    model: Path | None = None  # a local checkpoint directory; None: the built-in one
    backend: str = "auto"
    batch: int = 2
    tokens: int = 16
    graphs: bool = True
    overlap: bool = True
    prompt_length: int = 8

    def __post_init__(self):
        for name in ("batch", "tokens", "prompt_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DemoOptions.{name} must be an integer >= 1, got {value!r}")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "moe-triton" / DEMO_NAME


def build_demo_checkpoint(path: Path) -> Path:
    """Write the built-in checkpoint with save_pretrained, once; later runs reuse it."""
    if (path / "config.json").exists():
        return path
    from tqdm import tqdm
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM

    with tqdm(total=3, desc="building the demo checkpoint (random weights)", unit="step") as bar:
        config = Cohere2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, num_shared_experts=1, sliding_window=64,
                                  layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = Cohere2MoeForCausalLM(config)
        bar.update()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 1.0 if "embed" in name or "lm_head" in name else 0.15)
        bar.update()
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        bar.update()
    return path


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def resolution_line(resolution) -> str:
    """The demo's line on the experts backend; it says so when auto fell back to the torch reference."""
    line = f"experts backend: {resolution}"
    if resolution.torch_fallback:
        line += "\n  (fallback: the Triton kernels do not run here; the torch reference computes the experts)"
    return line


def run_demo(options: DemoOptions, print_=print) -> int:
    from transformers import AutoModelForCausalLM

    from ..models import load_model
    from ..platform import interpreter_enabled

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    path = options.model or build_demo_checkpoint(cache_dir())
    # The built-in model is tiny: float32 keeps its greedy tokens comparable with transformers'.
    dtype = torch.float32 if options.model is None or not on_gpu else torch.bfloat16
    where = torch.cuda.get_device_name() if on_gpu else (
        "CPU, Triton kernels in the interpreter (slow, a correctness path)" if interpreter_enabled() else "CPU")
    print_(f"model: {path}{'  (built-in: RANDOM weights, the tokens mean nothing)' if options.model is None else ''}")
    print_(f"device: {where}, dtype {str(dtype).removeprefix('torch.')}")
    steps = 5 if on_gpu and options.graphs and options.overlap else 4

    def phase(step: int, text: str) -> None:  # the long steps say what they do (the interpreter is slow)
        print_(f"[{step}/{steps}] {text} ...")
        sys.stdout.flush()

    phase(1, "loading the checkpoint through moe_triton.models")
    model = load_model(path, dtype=dtype, device=device, backend=options.backend)
    model.use_graphs, model.use_overlap = options.graphs and on_gpu, options.overlap and on_gpu
    layer = next(m for m in model.modules() if hasattr(m, "resolution"))
    print_(resolution_line(layer.resolution))

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (options.batch, options.prompt_length), generator=g).to(device)
    phase(2, f"generating {options.batch} x {options.tokens} tokens (the first run compiles the kernels"
             f"{', captures the decode graphs' if model.use_graphs else ''})")
    model.setup(options.batch, options.prompt_length + options.tokens)
    ours = model.generate(prompt, options.tokens)  # also the warm-up: kernels compile on first use
    phase(3, "timing generate and prefill")
    _, seconds = _timed(lambda: model.generate(prompt, options.tokens))
    _, prefill_seconds = _timed(lambda: model.prefill(prompt))

    phase(4, "generating the same tokens with transformers, the reference")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    expected = reference.generate(prompt, max_new_tokens=options.tokens, do_sample=False)
    match = torch.equal(ours, expected)

    rows = [("generate", options.batch * options.tokens / seconds, seconds * 1e3)]
    rows.append(("prefill", options.batch * options.prompt_length / prefill_seconds, prefill_seconds * 1e3))
    if on_gpu and options.graphs and options.overlap:  # the same generation without overlap
        phase(5, "generating again with overlap off")
        model.use_overlap = False
        model.setup(options.batch, options.prompt_length + options.tokens)
        serial_tokens = model.generate(prompt, options.tokens)
        _, serial_seconds = _timed(lambda: model.generate(prompt, options.tokens))
        match = match and torch.equal(serial_tokens, ours)
        rows.append(("generate, overlap off", options.batch * options.tokens / serial_seconds, serial_seconds * 1e3))
    print_(f"decode: {'CUDA graphs' if model.graphs is not None else 'eager'}, "
           f"overlap {'on' if options.overlap and on_gpu else 'off'}")
    print_(f"{'stage':<24}{'tokens/s':>12}{'ms':>12}")
    for name, rate, ms in rows:
        print_(f"{name:<24}{rate:>12.1f}{ms:>12.2f}")
    print_(f"tokens match transformers' generate: {'yes' if match else 'NO'} ({options.batch} x {options.tokens} tokens)")
    return 0 if match else 1
