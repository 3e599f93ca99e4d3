"""The model's embedding tables, built without nn.Embedding's default init.

Every weight of the model comes from a checkpoint or ``init_random_``, so the ``normal_`` fill nn.Embedding runs
on construction is thrown away; on the meta device (the loader's skeleton) its first call also imports torch's
decompositions, about 2 s of a server start.
"""

from __future__ import annotations

import torch
from torch import nn


def embedding(rows: int, dim: int, dtype: torch.dtype) -> nn.Embedding:
    """An ``nn.Embedding(rows, dim)`` whose weight is allocated on the default device and left unfilled."""
    return nn.Embedding(rows, dim, dtype=dtype, _weight=torch.empty(rows, dim, dtype=dtype))
