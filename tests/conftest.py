"""Shared test set-up: Triton kernels run interpreted on the CPU, and torch stays deterministic."""

import os

# Must be set before any Triton kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
