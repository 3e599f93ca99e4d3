"""FreeBlockQueue: the pool's free blocks as an intrusive doubly linked list, in LRU order.

Why not ``collections.deque``: a free block that still carries a block hash is a prefix-cache entry.
When a new request's prefix matches it, the block leaves the free list from wherever it sits, usually
the middle. ``deque.remove`` is O(n) in the queue length (hundreds of thousands of blocks on a real
pool), and it runs once per matched block of every request. With the links stored in the blocks
themselves (``prev_free`` / ``next_free``), removal is O(1) and no per-node wrapper is allocated.

Order::

    head sentinel <-> least recently freed <-> ... <-> most recently freed <-> tail sentinel
                      ^ popleft() evicts here                               append() adds here ^

Membership is O(1): a node is queued exactly when its links are set (sentinels make every queued
node's ``prev_free`` and ``next_free`` non-None); a node outside the queue has both links ``None``.

Not thread-safe: the owner (BlockPool, on the engine thread) serialises every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol


class FreeQueueNode(Protocol):
    """Anything with the two intrusive links (KVBlock in practice)."""

    prev_free: Any
    next_free: Any


class _Sentinel:
    """A head or tail end of the list; never handed out."""

    __slots__ = ("prev_free", "next_free")

    def __init__(self) -> None:
        self.prev_free: Any = None
        self.next_free: Any = None


class FreeBlockQueue:
    """Doubly linked LRU list of free nodes: O(1) popleft, append, remove, len and membership."""

    def __init__(self, nodes: Iterable[FreeQueueNode] = ()) -> None:
        """Start with ``nodes`` queued in the given order (front first)."""
        self._head = _Sentinel()
        self._tail = _Sentinel()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.append_n(nodes)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        """Front (next to evict) to back (most recently freed). Do not mutate the queue while iterating."""
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    @staticmethod
    def is_queued(node: FreeQueueNode) -> bool:
        """True when ``node`` is linked into a queue (O(1))."""
        return node.prev_free is not None

    def peek(self) -> Any | None:
        """The front node without removing it, or None when empty."""
        node = self._head.next_free
        return None if node is self._tail else node

    def popleft(self) -> Any:
        """Unlink and return the front (least recently freed) node; IndexError when empty."""
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        node = self._head.next_free
        self._unlink(node)
        return node

    def popleft_n(self, n: int) -> list[Any]:
        """Unlink and return the ``n`` front nodes, front first; IndexError (and no change) if fewer are queued."""
        if n < 0 or n > self._len:
            raise IndexError(f"cannot pop {n} nodes from a FreeBlockQueue of {self._len}")
        return [self.popleft() for _ in range(n)]

    def append(self, node: FreeQueueNode) -> None:
        """Link ``node`` at the back (most recently freed). ValueError if it is already queued."""
        if node.prev_free is not None or node.next_free is not None:
            raise ValueError(f"{node!r} is already in a free queue (double free?)")
        last = self._tail.prev_free
        node.prev_free = last
        node.next_free = self._tail
        last.next_free = node
        self._tail.prev_free = node
        self._len += 1

    def append_n(self, nodes: Iterable[FreeQueueNode]) -> None:
        """``append`` each node in order (the last one ends up at the back)."""
        for node in nodes:
            self.append(node)

    def remove(self, node: FreeQueueNode) -> None:
        """Unlink ``node`` from anywhere in the queue in O(1). ValueError if it is not queued."""
        if node.prev_free is None or node.next_free is None:
            raise ValueError(f"{node!r} is not in the free queue")
        self._unlink(node)

    def _unlink(self, node: Any) -> None:
        prev, nxt = node.prev_free, node.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        node.prev_free = node.next_free = None
        self._len -= 1

    def check_integrity(self) -> None:
        """Walk the list both ways; RuntimeError naming the first broken link, a cycle or a wrong length."""
        if self._head.prev_free is not None or self._tail.next_free is not None:
            raise RuntimeError("free queue: a sentinel has an outer link")
        node, seen = self._head, 0
        while node is not self._tail:
            nxt = node.next_free
            if nxt is None:
                raise RuntimeError(f"free queue: forward walk hit None after {seen} nodes (len says {self._len})")
            if nxt.prev_free is not node:
                raise RuntimeError(f"free queue: {nxt!r}.prev_free does not point back to {node!r}")
            if nxt is not self._tail:
                seen += 1
                if seen > self._len:
                    raise RuntimeError(f"free queue: more than len={self._len} nodes reachable (cycle or stale len)")
            node = nxt
        if seen != self._len:
            raise RuntimeError(f"free queue: {seen} nodes linked but len says {self._len}")
