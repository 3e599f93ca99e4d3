"""Shared tiny models for the engine tests (built once per session: they are read-only)."""

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.init import random_model


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny64(tiny_cfg):
    """float64 exactness mode: the oracle and the incremental path agree to ~1e-8."""
    return random_model(tiny_cfg, seed=1, dtype=torch.float64, with_dspark=False)


@pytest.fixture(scope="session")
def tiny32(tiny_cfg):
    return random_model(tiny_cfg, seed=2, dtype=torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()
