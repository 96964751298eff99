"""Shared test helpers: one `assert_close` with dtype-justified tolerances, poisoning, devices.

CPU runs execute every Triton kernel under the interpreter (TRITON_INTERPRET=1, set here before
triton is imported). GPU tests are marked `gpu` and skipped where CUDA is absent; run them on the
H200 with `pytest -m gpu`.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first `import moe_triton`: @triton.jit reads it when kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Relative-to-max-magnitude tolerances. float32 operands accumulate in float32 (the interpreter's
# dot is exact float32; on GPU fp32 runs with ieee precision); fp16 operands carry 11 mantissa bits
# and intermediates are rounded to fp16 once between stages; bf16 carries 8 bits.
TOLERANCE = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0):
    """Compare `actual` with a float32 reference: no NaN, and max |a - e| <= tol * max(|e|, 1e-6) * scale."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    dtype = dtype or actual.dtype
    actual = actual.float().cpu()
    expected = expected.float().cpu()
    assert not torch.isnan(actual).any(), "output holds NaN (an unwritten poisoned element?)"
    if expected.numel() == 0:
        return
    tol = TOLERANCE[dtype] * scale
    err = (actual - expected).abs().max().item()
    ref = max(expected.abs().max().item(), 1e-6)
    assert err <= tol * ref, f"max abs error {err:.3e} > {tol:.1e} * max|ref| {ref:.3e} ({dtype})"


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with NaN (floats) or a huge value (ints) so unwritten elements show."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def test_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


test_device.__test__ = False  # not a test


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run with `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty / empty_like during the test returns a poisoned buffer, so any element a
    kernel was meant to write but did not shows up as NaN (floats) or INT_MAX (ints)."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE saved in the Hub layout (the distributed model tests load it sharded)."""
    from test_models import randomize_, tiny_qwen3_moe

    path = tmp_path_factory.mktemp("qwen3_moe")
    randomize_(tiny_qwen3_moe().eval(), seed=1).save_pretrained(path)
    return str(path)
