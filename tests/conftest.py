"""Shared test set-up: Triton kernels run interpreted on the CPU, and torch stays deterministic."""

import os

# Must be set before any Triton kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread: the tests' tensors are small, and with 2 cores shared by server subprocesses a second
# intra-op thread spins instead of working (measured 5-10x slower float64 tests under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
