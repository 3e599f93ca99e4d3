"""The engine core in its own process at one rank (engine/parallel/executor.py + rank_worker.py), as
``flashtier serve`` runs it: concurrent streams equal the synchronous engine's, errors reach the caller, a
cancelled stream is aborted and its blocks freed, a failed start is one line, and a killed engine core ends
every request with ``EngineDeadError`` instead of a hang.

The module's one engine core is shared (a spawn costs ~3-5 s on a loaded 2-core machine); the kill test runs
last and ends it.
"""

import asyncio
import os
import signal
import time

import pytest

from flashtier.engine.client import EngineDeadError, QueueFullError
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.factory import build_model
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import start_engine_core
from flashtier.engine.parallel.rank_processes import RankStartError
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt

CONFIG = EngineConfig(max_num_batched_tokens=128, weights_seed=2)
KV = KVStoreConfig(block_size=16, num_blocks=200)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _engine(**kw) -> Engine:
    return Engine(build_model(CONFIG), EngineConfig(max_num_batched_tokens=128, weights_seed=2, **kw), KV)


async def _collect(client, rid, prompt, params):
    tokens, last = [], None
    async for out in client.generate(rid, prompt, params):
        for c in out.choices:
            tokens.extend(c.token_ids)
        last = out
    return tokens, last


@pytest.fixture(scope="module")
def core():
    client = start_engine_core(ParallelConfig(), CONFIG, KV, seed=0, threads=1, start_timeout_s=300)
    yield client
    asyncio.run(client.shutdown(2))


def test_concurrent_streams_match_the_sync_engine(core):
    prompts = [random_prompt(10 + 7 * i, seed=700 + i) for i in range(6)]
    sync = _engine()
    for i, p in enumerate(prompts):
        sync.add_request(f"s{i}", p, GREEDY)
    sync.add_request("off", prompts[0][:-1] + [prompts[0][-1] + 1], GREEDY)  # shows the comparison can fail
    want: dict[str, list[int]] = {}
    while sync.has_unfinished():
        for o in sync.step():
            for c in o.choices:
                want.setdefault(o.request_id, []).extend(c.token_ids)

    async def main():
        return await asyncio.gather(*(_collect(core, f"s{i}", p, GREEDY) for i, p in enumerate(prompts)))

    for i, (tokens, last) in enumerate(asyncio.run(main())):
        assert tokens == want[f"s{i}"] and last.finished and last.choices[-1].finish_reason == "length"
    assert want["off"] != want["s0"]
    assert core.engine_summary().startswith("engine: device cpu, dtype float32, HBM pool 200 blocks of 16 tokens")


def test_errors_surface_and_cancel_aborts(core):
    async def main():
        with pytest.raises(ValueError, match="context length"):
            await _collect(core, "bad", [5, 6], SamplingParams(max_tokens=10**8))
        stream = core.generate("long", random_prompt(30, seed=1),
                               SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # the client went away
        deadline = time.monotonic() + 60  # one step away; the bound only stops a hang
        while time.monotonic() < deadline:
            s = core.stats()
            if not (s.num_running or s.num_waiting or s.kv_usage):
                break
            await asyncio.sleep(0.02)
        s = core.stats()
        assert s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0, s

    asyncio.run(main())


def test_queue_bound_raises_queue_full():
    engine = _engine(max_waiting=1)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2))


def test_a_failed_start_is_one_line(tmp_path):
    config = EngineConfig(model_dir=str(tmp_path))  # an empty directory: no config.json
    with pytest.raises(RankStartError) as info:
        start_engine_core(ParallelConfig(), config, KV, seed=0, threads=1, start_timeout_s=300)
    message = str(info.value)
    assert message.startswith("rank 0 failed to start: ") and "\n" not in message


def test_an_engine_core_killed_at_start_up_is_one_line():
    """SIGKILL while the engine core warms up (it has said so: the phase callback runs then): ``start`` raises
    one line naming the rank, its pid and the signal, and nothing is left running."""
    import dataclasses

    from flashtier.engine.parallel.executor import EngineCoreClient
    from flashtier.engine.parallel.rank_worker import RankSpec

    config = dataclasses.replace(CONFIG, warmup=True, cuda_graph_sizes=(1, 2), max_num_seqs=2)
    holder: list[EngineCoreClient] = []

    def kill_it(phase: str) -> None:
        assert phase == "warming up"
        os.kill(holder[0].worker_pids[0], signal.SIGKILL)

    client = EngineCoreClient(RankSpec(ParallelConfig(), config, KV, 0, 0, threads=1), phase=kill_it)
    holder.append(client)
    with pytest.raises(RankStartError) as info:
        client.start(300)
    message = str(info.value)
    assert message == f"rank 0 (pid {client.worker_pids[0]}) exited with signal SIGKILL before its engine was ready"
    assert not client.ranks.procs[0].is_alive()


def test_offline_llm_api():
    from flashtier import LLM, SamplingParams as SP

    llm = LLM(preset="tiny", block_size=16, num_blocks=64)
    res = llm.generate(["Hello world", [5, 6, 7, 8]], SP(temperature=0, max_tokens=4, n=2, ignore_eos=True))
    assert [r.prompt for r in res] == ["Hello world", None]
    for r in res:
        assert [o.index for o in r.outputs] == [0, 1]
        assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in r.outputs)
        assert r.outputs[0].token_ids == r.outputs[1].token_ids  # greedy choices agree
    assert llm.engine.pool.num_used == 0


def test_a_killed_engine_core_ends_every_request(core):
    """Last: SIGKILL mid-generation. The stream raises EngineDeadError (the server answers 503), the client
    is unhealthy (/health 503), a new request is refused at once."""

    async def main():
        stream = core.generate("doomed", random_prompt(20, seed=3),
                               SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
        await stream.__anext__()
        os.kill(core.worker_pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not core.is_ready() and "rank 0" in core.error and "SIGKILL" in core.error
        with pytest.raises(EngineDeadError):
            await _collect(core, "late", [5, 6, 7], GREEDY)

    asyncio.run(asyncio.wait_for(main(), 120))
