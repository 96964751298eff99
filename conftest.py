"""One rule for tests/ and benchmarks/ alike: `@pytest.mark.gpu` items are skipped where CUDA is
absent (run them on the GPU machine with `pytest -m gpu`). Each folder's own conftest adds the
rest.

Under the Triton interpreter a kernel's `tl.dot` is numpy's matmul, OpenBLAS's sgemm: its Zen and
Haswell kernels give a row other bits by its place in the tile (seen on an AMD EPYC), so a kernel
that is batch-invariant on the GPU would not be under the interpreter. Its Sandybridge kernel
(AVX, any x86-64 CPU here) computes every row alike: chosen before torch loads numpy, over the
machine's own choice (these machines set OPENBLAS_CORETYPE=Haswell)."""
import os
import platform

if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run with `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
