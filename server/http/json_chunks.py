"""Large JSON arrays rendered in slices: ``json_array`` (for /tokenize's ids and token texts).

``json.dumps`` of one list holds the GIL until it is done: 160 ms for a million ids, during which the
event loop (on another thread) cannot run. Rendering slices of ``SLICE`` items hands the GIL back between
slices, and ``map_item`` lets a caller render derived values (token texts) without first building a
second list of the whole prompt's length. Separators and escaping are Starlette's JSONResponse's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["SLICE", "json_array"]

SLICE = 16384  # items per json.dumps call: a few ms of GIL each


def json_array(items: Sequence[Any], map_item: Callable[[Any], Any] | None = None) -> Iterator[bytes]:
    """The UTF-8 JSON text of ``[map_item(x) for x in items]`` (or of `items`), in pieces to join."""
    yield b"["
    for start in range(0, len(items), SLICE):
        part = items[start:start + SLICE]
        values = list(part) if map_item is None else [map_item(x) for x in part]
        text = json.dumps(values, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        yield (b"," if start else b"") + text[1:-1].encode("utf-8")
    yield b"]"
