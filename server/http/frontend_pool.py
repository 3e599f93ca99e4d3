"""FrontendPool: the few threads that do the front end's CPU work (tokenizing, rendering chat prompts,
detokenizing, parsing large bodies, rendering large JSON answers) off the event loop.

Why threads help at all: the `tokenizers` calls the tokenizer makes for long text (``encode_batch_fast``,
``decode_batch``) release the GIL while the Rust side works, and the Python parts are short steps between
which the interpreter hands the GIL to the loop thread (every 5 ms), so /health answers while a 20 MB
prompt is being tokenized. The pool is bounded (``--frontend-workers``, default min(4, CPUs)): a burst of
huge requests queues for a worker instead of taking every core from the engine. (The workers keep the
default CPU priority: a lowered one was tried and made the loop wait longer, since a worker descheduled
while it holds the GIL holds up the loop too.)

Memory: glibc keeps the heap pages a big request freed (the encoder's working memory, the body), so the
process would stay at its peak; ``release_memory`` runs ``malloc_trim(0)`` on a worker after such a
request, which hands them back to the system.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["INLINE_CHARS", "FrontendPool", "default_workers"]

T = TypeVar("T")

# Inputs up to this many characters (or ids) are processed inline on the loop: a thread hop costs more
# than tokenizing them (~1 µs per character), and this bounds what inline work can hold the loop (~5 ms).
INLINE_CHARS = 4096


def default_workers() -> int:
    """min(4, CPUs this process may run on)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None on a C library without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return functools.partial(trim, 0)


class FrontendPool:
    """A bounded ``ThreadPoolExecutor`` for the front end (owned by ``ServerState`` as ``cpu_pool``)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="flashtier-frontend")
        self._trim = _malloc_trim()
        self._trim_lock = threading.Lock()
        self._trim_queued = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker; waits for a free worker when all are busy.

        Exceptions of `fn` propagate. Cancelling the awaiting task (client gone) does not stop a call that
        already started: it runs to its end and its result is dropped.
        """
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def release_memory(self) -> None:
        """Queue one ``malloc_trim(0)`` on a worker (not the loop: it walks the heap); a trim already
        queued covers this call. No-op without glibc or after ``shutdown``."""
        if self._trim is None:
            return
        with self._trim_lock:
            if self._trim_queued:
                return
            self._trim_queued = True
        try:
            self._executor.submit(self._run_trim)
        except RuntimeError:  # shut down
            self._trim_queued = False

    def release_later(self, held: list) -> None:
        """Empty ``held`` on a worker: it holds the last references to something large the loop is done with (a
        prompt of millions of ids: freeing 4.5M Python ints takes ~80 ms, a stall of every request the loop
        serves). The caller drops its own references first. Inline after ``shutdown``."""
        try:
            self._executor.submit(held.clear)
        except RuntimeError:  # shut down
            held.clear()

    def _run_trim(self) -> None:
        with self._trim_lock:
            self._trim_queued = False
        assert self._trim is not None
        self._trim()  # ctypes releases the GIL for the call

    def shutdown(self) -> None:
        """Stop taking work; running calls finish in their threads (not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
