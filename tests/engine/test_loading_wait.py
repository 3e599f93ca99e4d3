"""The engine-core loop while a request waits in LOADING on a tier lookup: it waits instead of stepping idly,
and a finished lookup wakes it at once.

An idle step loop holds the GIL against the lookup's reader threads (each GIL release of theirs then costs up
to a switch interval): on an H200 a 100K-token restore that installs in ~32 ms took 6.9 s that way. The bound
here is on scheduler calls, not on wall time: the lookup is held open by a gate for HOLD_S seconds, and no
step may run in that time (a spinning loop makes thousands of calls).
"""

import asyncio
import concurrent.futures
import threading
import time

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .engine_core_harness import in_process_engine_core

BS = 16
HOLD_S = 0.4  # how long the gate keeps the lookup open
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


class GatedTiers(TierManager):
    """The real lookup (embedded snapshot pool, no SSD tier), its result held back until ``gate`` is set."""

    def __init__(self, config: KVStoreConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a lookup is held at the gate

    def lookup(self, query):
        inner = super().lookup(query)
        held: concurrent.futures.Future = concurrent.futures.Future()

        def release() -> None:
            self.waiting.set()
            self.gate.wait(60)
            held.set_result(inner.result())

        threading.Thread(target=release, daemon=True).start()
        return held


def _engine(model) -> tuple[Engine, GatedTiers]:
    kv = KVStoreConfig(block_size=BS, num_blocks=64)
    tiers = GatedTiers(kv)
    return Engine(model, EngineConfig(max_num_batched_tokens=128), kv, tiers), tiers


def _count_schedules(engine: Engine) -> list[int]:
    calls = [0]
    schedule = engine.scheduler.schedule

    def counted():
        calls[0] += 1
        return schedule()

    engine.scheduler.schedule = counted
    return calls


def test_the_loop_sleeps_while_a_lookup_is_open_and_wakes_when_it_finishes(tiny32):
    """The engine-core loop (rank_worker.RankLoop, driven by the real client over its pipe) reports the stall,
    the driver releases no step for it, and the finished lookup's wake-up (``Woken``) brings the next step."""
    engine, tiers = _engine(tiny32)
    calls = _count_schedules(engine)

    async def main():
        client = in_process_engine_core(engine)
        try:
            stream = client.generate("r", random_prompt(3 * BS + 5, seed=11), PARAMS)
            first = asyncio.ensure_future(stream.__anext__())
            assert await asyncio.to_thread(tiers.waiting.wait, 10), "the lookup never started"
            # the steps released before the stall was reported (at most the pacer's lookahead) have run once
            # the last report says stalled and nothing is in flight
            deadline = time.monotonic() + 20
            while client.pacer.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert client.pacer.in_flight == 0
            before = calls[0]
            await asyncio.sleep(HOLD_S)
            during = calls[0] - before
            t0 = time.monotonic()
            tiers.gate.set()
            out = await asyncio.wait_for(first, timeout=20)
            woke_s = time.monotonic() - t0
            async for last in stream:
                out = last
            return during, woke_s, out
        finally:
            tiers.gate.set()
            await client.shutdown(timeout=2)

    during, woke_s, out = asyncio.run(main())
    # a loop that steps while nothing can run makes thousands of calls in HOLD_S (each does nothing); the
    # engine core makes none: no step is released until the lookup's wake-up
    assert during == 0, f"{during} scheduler calls while the only request was LOADING"
    assert woke_s < 20 and out.finished and out.choices[0].finish_reason == "length"
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_stalled_only_while_nothing_can_run(tiny32):
    """``Engine.stalled`` after a step: True while the only request waits on its lookup, False once it runs;
    the wake callback fires once per finished lookup."""
    engine, tiers = _engine(tiny32)
    woken = []
    engine.set_wake(lambda: woken.append(threading.current_thread().name))
    engine.add_request("a", random_prompt(2 * BS + 3, seed=12), PARAMS)
    engine.step()
    assert engine.scheduler.loading and engine.stalled and not woken
    engine.step()
    assert engine.stalled
    tiers.gate.set()
    for _ in range(2000):
        if woken:
            break
        time.sleep(0.005)
    assert len(woken) == 1 and woken[0] != threading.current_thread().name  # on the thread that finished it
    engine.step()  # resumes (cold: nothing cached) and prefills
    assert not engine.stalled and engine.scheduler.running
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert len(woken) == 1
    engine.close()
