"""How much of a streamed text to hold back: the part that may be the start of a marker.

Text arrives in pieces; a marker (a stop string, `</think>`, the EOS text, a DSML tag) may be split
across two of them. The longest suffix of what has arrived that is a proper prefix of some marker is
held until the next piece decides it; the rest can be emitted. ``StopMatcher`` (choice_text.py) and
``DsmlStreamParser`` (dsml.py) both hold text this way.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["held_suffix"]


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
