"""ScriptedEngineClient: an ``EngineClient`` whose tokens come from a script instead of a model.

The random demo model never writes a tool call or a reasoning block; this client does, so the
server's whole path (encoding, admission, streaming, detokenization, DSML parsing, stop strings,
usage, metrics, aborts) can be tested with everything else real. It behaves like the engine at
the protocol level:

- ``generate`` raises ``QueueFullError`` when ``max_active`` requests are running, and
  ``ValueError`` when prompt + max_tokens exceeds ``max_model_len``;
- every step (``step_delay_s`` apart) emits up to ``tokens_per_step`` tokens per choice; a choice
  ends with "length" at ``max_tokens``, with "stop" at the EOS id (not emitted, reported as
  ``stop_token_id``) or at one of ``stop_token_ids``, or when its script runs out (as if EOS);
- ``abort`` (and cancelling the iteration) ends the request with "abort" and is recorded;
- with ``hold_after`` = k, a request stops after its k-th output and waits (``holding`` lists it) until
  ``release()``, an abort, ``shutdown`` or the cancellation of its iteration: a request that is certainly
  in flight, for as long as the test wants (the drain tests), with no timer;
- ``stats`` counts like the engine: prompt/generation tokens, prefix-cache queries/hits.

Prefix caching is modelled: prompt tokens covered by whole blocks shared with an earlier prompt
(or an earlier prompt followed by what was generated for it) count as cached ("hbm"), the rest as
computed; a ``cache_salt`` request neither hits nor is hit. Logprobs are deterministic made-up numbers with the
right shape (the sampled token first at rank 1, then neighbours).

It is safe to reconfigure between requests from another thread (tests do: the server runs in its
own thread); the record lists are appended to from the server's loop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashtier.engine.client import QueueFullError
from flashtier.engine.core.outputs import (
    CacheUsage,
    ChoiceDelta,
    EngineStats,
    RequestOutput,
    RequestTimes,
    TokenLogprob,
)
from flashtier.engine.sample.params import SamplingParams

__all__ = ["GenerateCall", "ScriptedEngineClient", "Script"]

# A script: the tokens of every choice, per-choice token lists, or a function of the request.
Script = Sequence[int] | Callable[[list[int], SamplingParams], Sequence[int] | Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None


class ScriptedEngineClient:
    """See the module docstring. All arguments may be changed later as attributes."""

    def __init__(self, script: Script = (), *, eos_token_id: int = 1, max_model_len: int = 8192,
                 vocab_size: int = 129280, tokens_per_step: int = 1, step_delay_s: float = 0.0,
                 max_active: int | None = None, ready: bool = True, block_size: int = 64,
                 hold_after: int | None = None) -> None:
        self.script: Script = script
        self._eos = eos_token_id
        self._max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokens_per_step = tokens_per_step
        self.step_delay_s = step_delay_s
        self.max_active = max_active
        self.ready = ready
        self.block_size = block_size
        self.hold_after = hold_after  # outputs a request makes before it holds until release() (None: never)
        self.on_hold: Callable[[str], None] | None = None  # called (on the loop) as a request starts holding
        self._holds: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self.tier_stats: dict[str, float] = {}  # reported as EngineStats.tiers
        self.calls: list[GenerateCall] = []
        self.aborted: list[str] = []  # ids passed to abort()
        self.cancelled: list[str] = []  # ids whose iteration was closed before they finished
        self.shutdown_calls: list[float] = []
        self._abort_requested: set[str] = set()
        self._active: set[str] = set()
        self._prompts: list[tuple[int, ...]] = []
        self._lock = threading.RLock()  # predicates of wait_for read properties that lock too
        self._changed = threading.Condition(self._lock)
        self._stats = EngineStats()

    # ---- EngineClient -----------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self._max_model_len = value

    @property
    def eos_token_id(self) -> int:
        return self._eos

    def is_ready(self) -> bool:
        return self.ready

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                num_running=len(self._active),
                num_waiting=0,
                num_loading=0,
                kv_usage=min(1.0, len(self._active) / 64),
                prefix_queries_tokens=self._stats.prefix_queries_tokens,
                prefix_hits_tokens=self._stats.prefix_hits_tokens,
                preemptions=0,
                prompt_tokens=self._stats.prompt_tokens,
                generation_tokens=self._stats.generation_tokens,
                global_kv_bytes_per_token=890.0,
                tiers=dict(self.tier_stats),
            )

    async def abort(self, request_id: str) -> None:
        with self._changed:
            self.aborted.append(request_id)
            if request_id in self._active:
                self._abort_requested.add(request_id)
                self._wake(request_id)
            self._changed.notify_all()

    async def shutdown(self, timeout: float = 10.0) -> None:
        with self._changed:
            self.shutdown_calls.append(timeout)
            self.ready = False
            self._abort_requested |= self._active
            for request_id in list(self._holds):
                self._wake(request_id)
            self._changed.notify_all()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        return self._generate(request_id, list(prompt_token_ids), params, cache_salt)

    # ---- test helpers -----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget recorded calls and aborts (keeps the configuration and the counters)."""
        with self._lock:
            self.calls.clear()
            self.aborted.clear()
            self.cancelled.clear()

    def wait_for(self, predicate: Callable[[ScriptedEngineClient], bool], timeout: float = 5.0) -> bool:
        """Block (in a test thread) until `predicate(self)` holds or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    @property
    def holding(self) -> list[str]:
        """Ids of the requests now held (``hold_after``)."""
        with self._lock:
            return list(self._holds)

    def release(self) -> None:
        """Stop holding (``hold_after`` = None) and let every held request go on. Any thread."""
        with self._changed:
            self.hold_after = None
            for request_id in list(self._holds):
                self._wake(request_id)
            self._changed.notify_all()

    def _wake(self, request_id: str) -> None:
        """Resolve a held request's future on its loop (callers hold the lock)."""
        held = self._holds.pop(request_id, None)
        if held is not None:
            loop, fut = held
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    async def _hold(self, request_id: str, outputs: int) -> None:
        """Wait until woken, unless (checked under the lock, as release() and abort() set them) holding ended
        meanwhile or the request is being aborted."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._changed:
            if self.hold_after is None or outputs < self.hold_after or request_id in self._abort_requested:
                return
            self._holds[request_id] = (loop, fut)
            self._changed.notify_all()
        if self.on_hold is not None:
            self.on_hold(request_id)
        try:
            await fut
        finally:
            with self._changed:
                self._holds.pop(request_id, None)
                self._changed.notify_all()

    # ---- the token source -------------------------------------------------------------------------------

    def _choice_scripts(self, prompt: list[int], params: SamplingParams) -> list[list[int]]:
        script = self.script(prompt, params) if callable(self.script) else self.script
        seq = list(script)
        if seq and not isinstance(seq[0], int):
            per_choice = [list(s) for s in seq]  # type: ignore[arg-type]
            return [per_choice[i % len(per_choice)] for i in range(params.n)]
        return [list(seq) for _ in range(params.n)]  # type: ignore[arg-type]

    def _cache_usage(self, prompt: list[int]) -> CacheUsage:
        best = 0
        for earlier in self._prompts:
            n = 0
            for a, b in zip(earlier, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        # whole blocks only, and never the last prompt token (it must be computed to sample)
        cached = min(best, len(prompt) - 1) // self.block_size * self.block_size
        return CacheUsage(cached_tokens=cached, hbm_tokens=cached, computed_tokens=len(prompt) - cached)

    def _logprobs(self, token_id: int, k: int) -> TokenLogprob:
        chosen = -0.25 - (token_id % 7) * 0.125
        top = [(token_id, chosen)] + [((token_id + j) % self.vocab_size, chosen - j) for j in range(1, k)]
        return TokenLogprob(token_id=token_id, logprob=chosen, rank=1, top=tuple(top[:k]))

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self._max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self._max_model_len}")
        scripts = self._choice_scripts(prompt, params)
        with self._changed:
            if self.max_active is not None and len(self._active) >= self.max_active:
                raise QueueFullError(f"{len(self._active)} requests active (bound {self.max_active})")
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already running")
            self._active.add(request_id)
            self.calls.append(GenerateCall(request_id, tuple(prompt), params, cache_salt))
            cache = self._cache_usage(prompt) if cache_salt is None else CacheUsage(computed_tokens=len(prompt))
            if cache_salt is None:
                self._prompts.append(tuple(prompt))
                del self._prompts[:-64]
            self._stats = EngineStats(
                prefix_queries_tokens=self._stats.prefix_queries_tokens + len(prompt),
                prefix_hits_tokens=self._stats.prefix_hits_tokens + cache.cached_tokens,
                prompt_tokens=self._stats.prompt_tokens + len(prompt),
                generation_tokens=self._stats.generation_tokens,
            )
            self._changed.notify_all()
        arrival = time.monotonic()
        pos = [0] * params.n
        produced = [0] * params.n
        emitted: list[list[int]] = [[] for _ in range(params.n)]
        done: list[str | None] = [None] * params.n
        stop_ids = set(params.stop_token_ids)
        first_token: float | None = None
        finished = False
        outputs = 0
        try:
            while True:
                if self.hold_after is not None and outputs >= self.hold_after:
                    await self._hold(request_id, outputs)
                await asyncio.sleep(self.step_delay_s)
                now = time.monotonic()
                if request_id in self._abort_requested:
                    finished = True
                    yield RequestOutput(
                        request_id, len(prompt),
                        tuple(ChoiceDelta(i, (), finish_reason="abort") for i in range(params.n) if done[i] is None),
                        finished=True, cache=cache, times=RequestTimes(arrival, arrival, first_token, now))
                    return
                deltas = []
                for i in range(params.n):
                    if done[i] is not None:
                        continue
                    toks: list[int] = []
                    lps: list[TokenLogprob] = []
                    reason: str | None = None
                    stop_tok: int | None = None
                    while len(toks) < self.tokens_per_step:
                        script = scripts[i]
                        if pos[i] >= len(script):
                            reason, stop_tok = "stop", self._eos
                            break
                        tok = script[pos[i]]
                        pos[i] += 1
                        if (tok == self._eos and not params.ignore_eos) or tok in stop_ids:
                            if produced[i] >= params.min_tokens:
                                reason, stop_tok = "stop", tok
                                break
                            continue  # masked before min_tokens: the script moves on
                        toks.append(tok)
                        emitted[i].append(tok)
                        produced[i] += 1
                        if params.logprobs is not None:
                            lps.append(self._logprobs(tok, params.logprobs + 1))
                        if produced[i] >= params.max_tokens:
                            reason = "length"
                            break
                    done[i] = reason
                    deltas.append(ChoiceDelta(i, tuple(toks), tuple(lps) if params.logprobs is not None else None,
                                              finish_reason=reason, stop_token_id=stop_tok))
                new_tokens = sum(len(d.token_ids) for d in deltas)
                if new_tokens and first_token is None:
                    first_token = now
                with self._lock:
                    self._stats = EngineStats(
                        prefix_queries_tokens=self._stats.prefix_queries_tokens,
                        prefix_hits_tokens=self._stats.prefix_hits_tokens,
                        prompt_tokens=self._stats.prompt_tokens,
                        generation_tokens=self._stats.generation_tokens + new_tokens,
                    )
                finished = all(d is not None for d in done)
                outputs += 1
                yield RequestOutput(request_id, len(prompt), tuple(deltas), finished=finished, cache=cache,
                                    times=RequestTimes(arrival, arrival, first_token, now if finished else None))
                if finished:
                    return
        finally:
            with self._changed:
                # generated tokens have KV too: a follow-up turn that repeats them can hit it
                if cache_salt is None:
                    self._prompts.extend(tuple(prompt + e) for e in emitted)
                    del self._prompts[:-64]
                self._active.discard(request_id)
                self._abort_requested.discard(request_id)
                if not finished:
                    self.cancelled.append(request_id)
                self._changed.notify_all()


# `flashtier serve` in front of this engine, as a process (scripted_serve.py, run by path: its folder is the only
# test folder on the child's sys.path, and the repository root is not on it).
SCRIPTED_SERVE_ARGV = (sys.executable, str(Path(__file__).with_name("scripted_serve.py")))
