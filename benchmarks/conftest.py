"""Benchmark fixtures: the device ceilings measured once per run, and a results table.

Run on the GPU machine:
    pytest benchmarks -m gpu --benchmark-only --bench-table docs/bench-layer.md
"""
import subprocess

import pytest
import torch

from moe_triton.bench import measure_ceilings

ROWS: list[dict] = []


def pytest_addoption(parser):
    parser.addoption("--bench-table", default=None, help="write the results table (markdown) to this path")


@pytest.fixture(scope="session")
def ceilings():
    if not torch.cuda.is_available():
        pytest.skip("benchmarks time the GPU")
    return measure_ceilings(torch.device("cuda"))


@pytest.fixture(scope="session")
def results():
    return ROWS


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not ROWS:
        return
    import triton

    columns = list(ROWS[0])
    lines = [
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"commit {_commit()}",
        f"ceilings: B = {ROWS[0]['_B_TBps']:.2f} TB/s (copy, read + write), F = {ROWS[0]['_F_TFLOPs']:.0f} TFLOP/s (bf16 matmul)",
        "",
    ]
    columns = [c for c in columns if not c.startswith("_")]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in ROWS:
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    text = "\n".join(lines)
    terminalreporter.write_line("\n" + text)
    path = config.getoption("--bench-table")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
