"""The README's front door stays true: CI runs the README's test command verbatim."""
import contextlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith("python3 -m venv .venv")
    assert ci_command in (ROOT / "README.md").read_text()


def readme_snippet(containing: str) -> str:
    """The README's python code block that contains `containing`."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    matches = [b for b in blocks if containing in b]
    assert len(matches) == 1, (f"expected one README snippet with {containing!r}, "
                               f"found {len(matches)}")
    return matches[0]


def test_readme_drop_in_snippets_run_and_match_transformers(tmp_path):
    import torch
    from helpers import all_sparse_qwen3_moe_checkpoint, assert_close
    from transformers import AutoModelForCausalLM

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path,
                                                        experts_implementation="eager")(ids).logits

    scope = {"path": path}
    exec(readme_snippet('from_pretrained(path, experts_implementation="moe_triton")'), scope)
    assert scope["model"].config._experts_implementation == "moe_triton"
    with torch.no_grad():
        assert_close(scope["model"](ids).logits, expected, torch.float32, scale=10)

    scope = {"model": AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"),
             "moe_triton": None}
    exec("import moe_triton\n" + readme_snippet("from_transformers"), scope)
    assert all(type(layer.mlp).__name__ == "FusedMoE" for layer in scope["model"].model.layers)
    with torch.no_grad():
        assert_close(scope["model"](ids).logits, expected, torch.float32, scale=10)


def test_readme_fp8_snippet_runs_and_matches_the_dequantized_reference():
    import torch
    from helpers import random_expert_weights

    from moe_triton import fused_experts_torch

    g = torch.Generator().manual_seed(6)
    w13, w2 = random_expert_weights(g, 4, 64, 48)
    hidden_states = torch.randn(5, 64, generator=g).half()
    topk_ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]).int()
    topk_weights = torch.rand(5, 2, generator=g)
    scope = dict(w13=w13, w2=w2, hidden_states=hidden_states, topk_ids=topk_ids,
                 topk_weights=topk_weights)
    exec(readme_snippet("to_format"), scope)
    reference = fused_experts_torch(hidden_states, *scope["fp8"].dequantized(), topk_ids,
                                    topk_weights)
    out = scope["out"]
    assert out.dtype == torch.float16
    # FP8's four roundings (x, w13, h, w2), each at most 2^-4 relative: see tests/test_fp8.py
    assert ((out.float() - reference).norm() / reference.norm()) < 0.1


def test_readme_compile_snippet_runs_in_one_graph(tmp_path, monkeypatch):
    import torch
    import torch._dynamo
    from helpers import all_sparse_qwen3_moe_checkpoint

    # inductor's C++ build takes ~40 s here: the CPU check traces with aot_eager
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda model, **kwargs: compile_(model, backend="aot_eager", **kwargs))
    input_ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    scope = {"path": all_sparse_qwen3_moe_checkpoint(tmp_path), "input_ids": input_ids}
    exec(readme_snippet('from_pretrained(path, experts_implementation="moe_triton")')
         + readme_snippet("torch.compile(model"),
         scope)
    with torch.no_grad():
        expected = scope["model"](input_ids, use_cache=False).logits
    assert torch.equal(scope["logits"], expected)
    torch._dynamo.reset()


def test_readme_fp8_drop_in_snippet_runs_transformers_fp8_experts_on_our_kernels(tmp_path,
                                                                                 monkeypatch):
    """The snippet on an FP8 checkpoint (experts quantized by transformers' own FineGrainedFP8,
    float16): on CPU as a user gets it (transformers dequantizes; our unquantized kernels), and as
    on an FP8 GPU, where transformers keeps its FP8Experts (emulated with
    helpers.fp8_quantizer_on_cpu, whose one patch lets transformers keep FP8 without a GPU) and our
    FP8 kernels run them, under the interpreter. Both against transformers' dequantize=True model:
    float16 rounding, and FP8's activation roundings
    (tests/test_models_fp8.py: 0.05 relative)."""
    import torch
    from helpers import (
        experts_fp8_qwen3_checkpoint,
        fp8_quantizer_on_cpu,
        relative_error,
        spy_on_fp8_experts,
    )
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    # the interpreter's dtype
    fp8_path = experts_fp8_qwen3_checkpoint(tmp_path, 64, 32, 16, (32, 32), "float16")
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(
            fp8_path, quantization_config=FineGrainedFP8Config(dequantize=True),
            dtype=torch.float32)(ids).logits

    calls = spy_on_fp8_experts(monkeypatch)  # what transformers calls
    for on_fp8_gpu in (False, True):
        scope = {"fp8_path": fp8_path}
        with fp8_quantizer_on_cpu() if on_fp8_gpu else contextlib.nullcontext():
            exec(readme_snippet("fp8_path"), scope)
        experts = scope["model"].model.layers[0].mlp.experts
        assert (type(experts).__name__ == "FP8Experts") == on_fp8_gpu
        assert (experts.gate_up_proj.dtype == torch.float8_e4m3fn) == on_fp8_gpu
        with torch.no_grad():
            logits = scope["model"](ids).logits
        assert relative_error(logits, expected) < (0.05 if on_fp8_gpu else 2e-3)
        # one call per MoE layer, FP8 only on the FP8 path
        assert len(calls) == (2 if on_fp8_gpu else 0)
