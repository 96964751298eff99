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
    assert "tokens match transformers' generate: yes" in out
    assert "generate" in out and "prefill" in out
    assert "[1/4] loading" in out and "[4/4] generating the same tokens with transformers" in out  # no silent phases
    assert (tmp_path / "cache" / "moe-triton").exists()  # built once, cached


@pytest.mark.parametrize("setup,match", [
    (lambda d: None, "not a checkpoint directory"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'),
     "unsupported architecture"),
])
def test_demo_errors_are_one_line(tmp_path, setup, match):
    model = tmp_path / "model"
    model.mkdir()
    setup(model)
    result = run_cli("demo", "--model", str(model), tmp_path=tmp_path, env_extra={"TRITON_INTERPRET": "1"})
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("moe-triton demo:")]) == 1
