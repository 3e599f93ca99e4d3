"""BlockTable's int32 array mirrors its id list through every mutation, and a step's metadata copies the tables
from it (engine/runner/step_metadata.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.engine.runner.step_metadata import pinned_to


def _check(t: BlockTable) -> None:
    assert t.array().dtype == np.int32 and t.array().tolist() == t.ids
    assert t.tensor().dtype == torch.long and t.tensor().tolist() == t.ids


def test_array_follows_appends_across_growth_and_replacements():
    t = BlockTable([7, 3])
    _check(t)
    for b in range(100, 140):  # past the first capacities (16, 32): the array is reallocated
        t.append(b)
        _check(t)
    t.replace(t.ids[:5])  # a rollback
    _check(t)
    t.replace(list(range(1000, 1300)))  # a resume installing a long table at once
    _check(t)
    t.replace([])
    _check(t)
    assert len(t.array()) == 0


def test_array_is_a_read_only_view():
    t = BlockTable([1, 2, 3])
    with pytest.raises(ValueError):
        t.array()[0] = 9
    assert t.ids == [1, 2, 3]


def test_stale_tensor_is_dropped_on_append():
    t = BlockTable([1, 2])
    first = t.tensor()
    t.append(5)
    assert first.tolist() == [1, 2] and t.tensor().tolist() == [1, 2, 5]


def test_pinned_to_takes_an_array_of_the_wanted_dtype_as_is_and_converts_others():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert pinned_to(a, torch.device("cpu"), torch.int32).dtype == torch.int32
    assert pinned_to(a, torch.device("cpu"), torch.int32).tolist() == a.tolist()
    assert pinned_to(a, torch.device("cpu")).dtype == torch.long  # int32 array, long wanted: converted
    assert pinned_to([[1, 2], [3, 4]], torch.device("cpu"), torch.int32).tolist() == [[1, 2], [3, 4]]
