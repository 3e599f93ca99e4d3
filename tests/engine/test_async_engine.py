"""AsyncEngine: concurrent streams, errors through the future, cancellation aborts and frees blocks."""

import asyncio

import pytest

from flashtier.engine.async_engine import AsyncEngine
from flashtier.engine.client import QueueFullError
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt


def _engine(model, **kw):
    return Engine(model, EngineConfig(max_num_batched_tokens=128, **kw), KVStoreConfig(block_size=16, num_blocks=200))


async def _collect(client, rid, prompt, params):
    tokens, last = [], None
    async for out in client.generate(rid, prompt, params):
        for c in out.choices:
            tokens.extend(c.token_ids)
        last = out
    return tokens, last


def test_concurrent_streams_match_the_sync_engine(tiny32):
    prompts = [random_prompt(10 + 7 * i, seed=700 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sync = _engine(tiny32)
    for i, p in enumerate(prompts):
        sync.add_request(f"s{i}", p, params)
    want: dict[str, list[int]] = {}
    while sync.has_unfinished():
        for o in sync.step():
            for c in o.choices:
                want.setdefault(o.request_id, []).extend(c.token_ids)

    async def main():
        client = AsyncEngine(_engine(tiny32)).start()
        try:
            results = await asyncio.gather(*(_collect(client, f"s{i}", p, params) for i, p in enumerate(prompts)))
        finally:
            await client.shutdown(timeout=2)
        return results

    for i, (tokens, last) in enumerate(asyncio.run(main())):
        assert tokens == want[f"s{i}"] and last.finished and last.choices[-1].finish_reason == "length"


def test_errors_surface_and_cancel_aborts(tiny32):
    async def main():
        engine = _engine(tiny32, max_waiting=1)
        client = AsyncEngine(engine).start()
        try:
            with pytest.raises(ValueError, match="context length"):
                await _collect(client, "bad", [5, 6], SamplingParams(max_tokens=10**8))
            stream = client.generate("long", random_prompt(30, seed=1),
                                     SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
            first = await stream.__anext__()
            assert not first.finished
            await stream.aclose()  # the client went away
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not engine.has_unfinished():
                    break
            assert not engine.has_unfinished() and engine.pool.num_used == 0
            engine.check_integrity()
        finally:
            await client.shutdown(timeout=1)

    asyncio.run(main())


def test_queue_bound_raises_queue_full(tiny32):
    engine = _engine(tiny32, max_waiting=1)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2))


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
