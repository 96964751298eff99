"""Benchmark fixtures: the device ceilings measured once per run, and result tables.

Run on the GPU machine:
    pytest benchmarks -m gpu --benchmark-only --bench-table docs/bench.md
Regression runs (README, "Benchmark regression runs"): save a baseline with --benchmark-save,
compare with --benchmark-compare --benchmark-compare-fail=median:20%. Setting
MOE_TRITON_BENCH_SLOWDOWN=1 runs a deliberately slowed variant (small tiles, no TMA) that such a
comparison must fail: the proof that the check can fail.
"""
import math
import os
from dataclasses import replace

import pytest
import torch

from moe_triton.tools.bench import Ceilings, measure_ceilings

TABLES: dict[str, list[dict]] = {}
CEILINGS: list[Ceilings] = []


def pytest_configure(config):
    # read here, at the entry point, never in the library
    if os.environ.get("MOE_TRITON_BENCH_SLOWDOWN"):
        import moe_triton.pipeline as pipeline

        choose = pipeline.choose_config

        def slowed(*args, **kwargs):
            tiles = choose(*args, **kwargs)
            slow = dict(block_n=32, block_c=32, num_stages=2, tma_weights=False)
            return replace(tiles, up=replace(tiles.up, **slow), down=replace(tiles.down, **slow))

        pipeline.choose_config = slowed


def pytest_benchmark_update_machine_info(config, machine_info):
    """Saved baselines name the accelerator and the stack they were measured with."""
    import triton

    machine_info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    machine_info["torch"], machine_info["triton"] = torch.__version__, triton.__version__


def pytest_addoption(parser):
    parser.addoption("--bench-table", default=None,
                     help="write the result tables (markdown) to this path")


@pytest.fixture(scope="session")
def ceilings():
    if not torch.cuda.is_available():
        pytest.skip("benchmarks time the GPU")
    CEILINGS.append(measure_ceilings(torch.device("cuda")))
    return CEILINGS[0]


@pytest.fixture(scope="session")
def record():
    """record(table, row): add one row (a dict; keys are the columns) to a named result table."""
    return lambda table, row: TABLES.setdefault(table, []).append(row)


def _markdown(rows: list[dict]) -> list[str]:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]


def _fraction_summary(rows: list[dict]) -> list[str]:
    """Geometric mean and minimum of each `*_frac` column (fractions of the floor) of a table."""
    lines = []
    for column in [c for c in rows[0] if c.endswith("_frac")]:
        fractions = [float(row[column]) for row in rows]
        geomean = math.exp(sum(math.log(f) for f in fractions) / len(fractions))
        lowest = min(rows, key=lambda row: float(row[column]))
        where = ", ".join(f"{k}={lowest[k]}" for k in ("shape", "format", "M") if k in lowest)
        lines.append(f"{column} over {len(fractions)} rows: geometric mean {geomean:.3f}, "
                     f"minimum {float(lowest[column]):.2f} ({where})")
    return ["", *lines] if lines else []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TABLES:
        return
    import triton

    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}"]
    if CEILINGS:
        c = CEILINGS[0]
        lines.append(f"ceilings: B = {c.bandwidth / 1e12:.2f} TB/s (copy, read + write), "
                     f"F = {c.matmul_flops / 1e12:.0f} TFLOP/s (bf16 matmul), "
                     f"F8 = {c.fp8_matmul_flops / 1e12:.0f} TFLOP/s (FP8 torch._scaled_mm)")
    for table, rows in TABLES.items():
        lines += ["", f"### {table}", ""] + _markdown(rows) + _fraction_summary(rows)
    text = "\n".join(lines)
    terminalreporter.write_line("\n" + text)
    path = config.getoption("--bench-table")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
