"""When the engine thread hands a step's outputs to the event loop (engine/output_handoff.py, AsyncEngine).

OutputHandoff on a manual clock: device-bound decode steps (host 5 ms, then 60 ms on the device) hand step N
over once step N+1's forward is queued; host-bound steps (the CPU) at their own end; a prefill step before its
forward, without changing the decision. AsyncEngine over a scripted engine: every hand-off lands where the
policy says (read on the engine thread at the ``call_soon_threadsafe``), one wake-up of the loop per step.
Engine (tiny model) under AsyncEngine: the hook comes once per step, after a decode step's forward is queued
and before a prefill step's forward, and the loop is woken once per step, never once per request.
"""

import asyncio
from types import SimpleNamespace

import pytest

from flashtier.engine.async_engine import AsyncEngine
from flashtier.engine.config import EngineConfig
from flashtier.engine.runner.decode_step import is_plain_decode
from flashtier.engine.engine import Engine
from flashtier.engine.output_handoff import OutputHandoff
from flashtier.engine.core.outputs import ChoiceDelta, RequestOutput
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt

DEVICE_BOUND = (0.005, 0.060)  # (host s before the forward is queued, s after it): CUDA graphs
HOST_BOUND = (0.060, 0.002)  # the forward is host work (the CPU, eager launches)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, 1, (ChoiceDelta(0, (token,)),), finished)


def drive(profiles, *, plain=None, now=None):
    """Run OutputHandoff through steps k = 0.. with (host, after) times; step k outputs token k; ``plain[k]``:
    a plain decode step (default all), ``now[k]``: a step follows at once (default all but the last). Returns
    the deliveries as (where, step, tokens) and the handoff."""
    clock, where, log = Clock(), [None], []
    h = OutputHandoff(lambda outs: log.append((*where[0], [o.choices[0].token_ids[0] for o in outs])), clock)
    for k, (host, after) in enumerate(profiles):
        queued = plain is None or plain[k]
        h.begin_step()
        clock.t += host
        where[0] = ("point", k)
        h.point(queued)
        clock.t += after
        where[0] = ("end", k)
        h.end_step([out("r", k)], next_step_now=now[k] if now else k < len(profiles) - 1)
    return log, h


def test_device_bound_steps_hand_over_once_the_next_forward_is_queued():
    log, h = drive([DEVICE_BOUND] * 5)
    assert log == [("point", 1, [0]), ("point", 2, [1]), ("point", 3, [2]), ("point", 4, [3]), ("end", 4, [4])]
    assert h.defer and h.handoffs == 5


def test_host_bound_steps_hand_over_at_their_end():
    log, h = drive([HOST_BOUND] * 4)
    assert log == [("end", k, [k]) for k in range(4)]
    assert not h.defer


def test_prefill_step_hands_over_before_its_forward_and_keeps_the_decision():
    # device-bound decode, then a prefill step (the point before a long eager forward), then decode again
    log, h = drive([DEVICE_BOUND, DEVICE_BOUND, (0.001, 0.300), DEVICE_BOUND], plain=[True, True, False, True])
    assert log == [("point", 1, [0]), ("point", 2, [1]), ("point", 3, [2]), ("end", 3, [3])]
    # host-bound decode stays undeferred across a prefill step that looks device-bound from its point
    log, h = drive([HOST_BOUND, (0.001, 0.300), HOST_BOUND], plain=[True, False, True])
    assert log == [("end", k, [k]) for k in range(3)] and not h.defer


def test_nothing_held_when_no_step_follows_at_once():
    """The engine stalled after step 1 (or has nothing left): its outputs go at its end, deferring or not."""
    log, h = drive([DEVICE_BOUND] * 4, now=[True, False, True, False])
    assert log == [("point", 1, [0]), ("end", 1, [1]), ("point", 3, [2]), ("end", 3, [3])] and h.defer


def test_a_step_without_the_hook_delivers_in_step_order():
    clock, log = Clock(), []
    h = OutputHandoff(lambda outs: log.append([o.choices[0].token_ids[0] for o in outs]), clock)
    for k in range(2):  # device-bound: step 0 decides to defer, step 1 holds too
        h.begin_step()
        clock.t += 0.005
        if k == 0:
            h.point(True)
        clock.t += 0.060
        h.end_step([out("r", k)], next_step_now=True)
    assert log == [] and h.defer
    h.flush()
    h.flush()
    h.end_step([], next_step_now=False)
    assert log == [[0, 1]] and h.handoffs == 1


class ScriptedDevice:
    """A duck-typed Engine whose decode steps spend `host` then `after` on `clock` around the hand-off hook;
    each request gets the step index as its token until max_tokens. ``phase``: (step, "host" | "queued" |
    "done"), read by the test when AsyncEngine wakes the loop."""

    def __init__(self, clock: Clock, host: float, after: float) -> None:
        self.clock, self.host, self.after = clock, host, after
        self.model = SimpleNamespace(cfg=SimpleNamespace(eos_token_id=1, vocab_size=1000))
        self.max_model_len, self.stalled, self.steps, self.phase = 4096, False, 0, (0, "idle")
        self.left: dict[str, int] = {}
        self.hook = None

    def set_wake(self, wake) -> None:
        pass

    def set_handoff_hook(self, hook) -> None:
        self.hook = hook

    def add_request(self, rid, prompt, params, cache_salt=None) -> None:
        self.left[rid] = params.max_tokens

    def abort(self, rid) -> None:
        self.left.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        k = self.steps
        self.phase = (k, "host")
        self.clock.t += self.host
        self.phase = (k, "queued")
        self.hook(True)
        self.clock.t += self.after
        self.phase = (k, "done")
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(out(rid, k, finished=self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        self.steps += 1
        return outs


async def _stream_all(client, n: int, tokens: int) -> tuple[list, list]:
    """n concurrent requests, all submitted before the engine thread starts; (their token lists, the loop's
    wake-ups from the engine thread as (engine phase, tokens carried))."""
    loop = asyncio.get_running_loop()
    real, wakeups = loop.call_soon_threadsafe, []

    def counting(cb, *args, **kw):
        name = getattr(cb, "__name__", "")
        if name == "_put_all" or (name == "put_nowait" and isinstance(args[0], RequestOutput)):  # (or per output)
            items = args[0] if name == "_put_all" else [(None, args[0])]
            wakeups.append((getattr(client.engine, "phase", None), [o.choices[0].token_ids[0] for _, o in items]))
        return real(cb, *args, **kw)

    loop.call_soon_threadsafe = counting
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    async def one(i):
        got = []
        async for o in client.generate(f"r{i}", random_prompt(20 + i, seed=i), params):
            got.extend(t for c in o.choices for t in c.token_ids)
        return got

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.sleep(0)  # every request's AddCommand is queued: the first step sees them all
    client.start()
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), 60), wakeups  # a dead engine thread fails, not hangs
    finally:
        await client.shutdown(timeout=2)


@pytest.mark.parametrize("profile", ["device_bound", "host_bound"])
def test_async_engine_wakes_the_loop_once_per_step_where_the_policy_says(profile):
    clock = Clock()
    engine = ScriptedDevice(clock, *(DEVICE_BOUND if profile == "device_bound" else HOST_BOUND))
    results, wakeups = asyncio.run(_stream_all(AsyncEngine(engine, clock=clock), 3, 6))
    assert results == [list(range(6))] * 3 and engine.steps == 6
    assert [tokens for _, tokens in wakeups] == [[k] * 3 for k in range(6)]  # a step's outputs, all, at once
    if profile == "device_bound":  # step k once step k+1's forward is queued; the last one at its end
        assert [phase for phase, _ in wakeups] == [(k, "queued") for k in range(1, 6)] + [(5, "done")]
    else:
        assert [phase for phase, _ in wakeups] == [(k, "done") for k in range(6)]


def test_engine_hook_once_per_step_and_one_wakeup_per_step(tiny32):
    """The real engine under AsyncEngine: the hook before a prefill / replay forward, after a plain decode
    forward; the loop woken at most once per step (before: once per request and step)."""
    engine = Engine(tiny32, EngineConfig(max_num_batched_tokens=128), KVStoreConfig(block_size=16, num_blocks=200))
    per_step, outputs = [], []
    real_execute, real_step, real_set = engine.runner.execute, engine.step, engine.set_handoff_hook

    def execute(sched):
        per_step[-1].append("decode forward" if is_plain_decode(sched) else "other forward")
        return real_execute(sched)

    def step():
        per_step.append([])
        outputs.append(real_step())
        return outputs[-1]

    def set_handoff_hook(hook):  # AsyncEngine installs its hook through it: record each call, then pass it on
        real_set(lambda queued: (per_step[-1].append(f"hook {queued}"), hook(queued)))

    engine.runner.execute, engine.step, engine.set_handoff_hook = execute, step, set_handoff_hook
    results, wakeups = asyncio.run(_stream_all(AsyncEngine(engine), 4, 3))
    assert [len(r) for r in results] == [3] * 4
    assert per_step[0] == ["hook False", "other forward"]
    assert per_step[-1] == ["decode forward", "hook True"]
    assert all(s in (["hook False", "other forward"], ["decode forward", "hook True"]) for s in per_step)
    assert sum(len(tokens) for _, tokens in wakeups) == 12
    assert len(wakeups) <= sum(1 for outs in outputs if outs)  # one per step at most, never one per request
