"""The README's front door stays true: CI runs the README's test command verbatim."""
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
    assert len(matches) == 1, f"expected one README snippet with {containing!r}, found {len(matches)}"
    return matches[0]


def test_readme_drop_in_snippets_run_and_match_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import all_sparse_qwen3_moe_checkpoint, assert_close

    path = all_sparse_qwen3_moe_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")(ids).logits

    scope = {"path": path}
    exec(readme_snippet('experts_implementation="moe_triton"'), scope)
    assert scope["model"].config._experts_implementation == "moe_triton"
    with torch.no_grad():
        assert_close(scope["model"](ids).logits, expected, torch.float32, scale=10)

    scope = {"model": AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager"), "moe_triton": None}
    exec("import moe_triton\n" + readme_snippet("from_transformers"), scope)
    assert all(type(layer.mlp).__name__ == "FusedMoE" for layer in scope["model"].model.layers)
    with torch.no_grad():
        assert_close(scope["model"](ids).logits, expected, torch.float32, scale=10)
