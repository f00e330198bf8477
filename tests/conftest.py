"""Shared test set-up.

Triton kernels run on the CPU through Triton's interpreter when no CUDA device is
present; the variable must be set before triton is first imported. Tests marked
`gpu` are skipped without a CUDA device.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
