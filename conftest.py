"""One rule for tests/ and benchmarks/ alike: `@pytest.mark.gpu` items are skipped where CUDA is
absent (run them on the GPU machine with `pytest -m gpu`). Each folder's own conftest adds the
rest."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run with `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
