"""Shared test setup: the ``gpu`` marker skips with a reason where no CUDA GPU is present."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run scripts/gpu_check.sh on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def gen():
    """A seeded CPU generator: fresh random inputs every test, reproducible runs."""
    return torch.Generator().manual_seed(1234)
