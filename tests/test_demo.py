"""`moe-triton demo`, the main job: end to end on the CPU (Triton interpreter), and its errors."""
import os
import subprocess
import sys

import pytest


def run_cli(*args, tmp_path, env_extra=None):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "moe_triton", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_demo_runs_end_to_end_and_matches_transformers(tmp_path):
    result = run_cli("demo", "--tokens", "6", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "RANDOM weights" in out and "experts backend: triton" in out and "interpreter" in out
    assert "experts format: unquantized (on triton)" in out
    assert "tokens match transformers' generate: yes" in out
    assert "generate" in out and "prefill" in out
    assert "[1/4] loading" in out and "[4/4] generating the same tokens with transformers" in out  # no silent phases
    assert (tmp_path / "cache" / "moe-triton").exists()  # built once, cached


def test_demo_quant_fp8_runs_fp8_kernels_and_model_accepts_the_fp8_checkpoint(tmp_path):
    """--quant fp8: the built-in model written as an FP8 checkpoint, its experts on the Triton FP8 kernels
    (interpreted, float16), within FP8's logit error of transformers on the dequantized checkpoint. Then
    --model on that checkpoint: float32 on CPU, the experts dequantized by the torch reference, so the
    greedy tokens equal transformers' exactly."""
    result = run_cli("demo", "--quant", "fp8", "--tokens", "4", "--batch", "1", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "experts backend: triton" in out and "experts format: fp8 e4m3, 16x16 block scales" in out
    assert "relative error" in out and "(FP8 bound 0.05): ok" in out and "tokens equal to transformers' generate" in out
    checkpoint = tmp_path / "cache" / "moe-triton" / "cohere2-moe-tiny-random-fp8-v1"
    result = run_cli("demo", "--model", str(checkpoint), "--tokens", "4", "--batch", "1", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "experts format: fp8 e4m3, 16x16 block scales, dynamic per-token-group activations (on torch)" in result.stdout
    assert "tokens match transformers' generate: yes" in result.stdout


def test_demo_agrees_with_transformers_when_sequences_stop_at_eos(tmp_path):
    """A checkpoint whose generation_config.json names eos ids that the demo's two prompts hit early, at
    different steps: the demo's generate stops them as transformers' does, and it says so."""
    import torch
    from helpers import FAMILIES, eos_for_early_stops, randomize_

    from moe_triton.tools.demo import DemoOptions, run_demo

    make, seed = FAMILIES["minimax_m2"]
    torch.manual_seed(0)
    reference = randomize_(make().eval(), seed=seed)
    options = DemoOptions(model=tmp_path, backend="torch", tokens=12)  # torch experts: the demo's cheapest run
    g = torch.Generator().manual_seed(1)  # the demo's prompts
    prompts = torch.randint(0, reference.config.vocab_size, (options.batch, options.prompt_length), generator=g)
    free = reference.generate(prompts, max_new_tokens=options.tokens, do_sample=False)
    eos, stops = eos_for_early_stops(free, options.prompt_length)
    assert None not in stops, stops
    reference.generation_config.eos_token_id = eos
    reference.save_pretrained(tmp_path)
    lines = []
    assert run_demo(options, print_=lines.append) == 0, lines
    assert f"tokens match transformers' generate: yes (2 x {max(stops) + 1} tokens, stopped at EOS)" in lines


@pytest.mark.parametrize("setup,match", [
    (lambda d: None, "not a checkpoint directory"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'),
     "unsupported architecture"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", '
                                              '"quantization_config": {"quant_method": "awq"}}'),
     "quant_method='awq': expected 'fp8'"),
])
def test_demo_errors_are_one_line(tmp_path, setup, match):
    model = tmp_path / "model"
    model.mkdir()
    setup(model)
    result = run_cli("demo", "--model", str(model), tmp_path=tmp_path, env_extra={"TRITON_INTERPRET": "1"})
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("moe-triton demo:")]) == 1


def test_demo_quant_fp8_with_a_model_is_refused_in_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = run_cli("demo", "--quant", "fp8", "--model", str(model), tmp_path=tmp_path, env_extra={"TRITON_INTERPRET": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--quant fp8 builds the built-in model in FP8" in result.stderr and len(result.stderr.strip().splitlines()) == 1
