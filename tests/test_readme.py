"""The README's front door stays true: CI runs the README's test command verbatim."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith("python3 -m venv .venv")
    assert ci_command in (ROOT / "README.md").read_text()
