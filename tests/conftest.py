"""What pytest needs here: the interpreter switch and the shared fixtures (the GPU skip:
../conftest.py).

CPU runs execute every Triton kernel under the interpreter (TRITON_INTERPRET=1, set here before
triton is imported). A test that needs CUDA carries `@pytest.mark.gpu` and lives in the test file of
the module it tests, beside that module's CPU tests; it is skipped where CUDA is absent. Run
them on the H200 with `pytest -m gpu`. Helpers the tests share live in tests/helpers.py, not here.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first `import moe_triton`: @triton.jit reads it when kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import poison_, randomize_, tiny_qwen3_moe  # noqa: E402  (imports moe_triton)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty / empty_like during the test returns a poisoned buffer, so any element a
    kernel was meant to write but did not shows up as NaN (floats) or INT_MAX (ints)."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


@pytest.fixture
def no_launch(monkeypatch):
    """Any stage kernel launched during the test (every one goes through a BoundLaunch) fails it."""
    from moe_triton.launch import BoundLaunch

    monkeypatch.setattr(BoundLaunch, "__call__",
                        lambda *a, **k: pytest.fail("a kernel was launched"))


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE saved in the Hub layout (the distributed model tests load it
    sharded)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    randomize_(tiny_qwen3_moe().eval(), seed=1).save_pretrained(path)
    return str(path)
