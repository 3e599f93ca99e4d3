"""The response store: its backends on their own (disk: atomic files, modes, expiry, sweeps, corrupt and
unwritable; Redis: a real redis-server, keys, TTL, a server that stops and comes back; memory; which
backend the settings choose), then through live servers: the TTL, ``previous_response_id`` across a
server restart on the same KV directory and on the same Redis, and a Redis that is down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
import uuid

import openai
import pytest

from flashtier.server.text.chat_encoding import encode_to_ids
from flashtier.server.response_store.store import MemoryResponseStore, StoredResponse, open_response_store
from flashtier.server.response_store.disk_store import DiskResponseStore
from flashtier.server.response_store.redis_store import RedisResponseStore
from flashtier.server.config.settings import build_settings

from ..kvstore.redis_server import RedisServer, free_port
from .conftest import DEFAULT_REPLY, run_server


def _record(text: str = "hello") -> StoredResponse:
    rid = f"resp_{uuid.uuid4().hex}"
    response = {"id": rid, "object": "response", "status": "completed",
                "output": [{"type": "message", "id": f"msg_{rid[5:]}_0", "role": "assistant",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]}]}
    return StoredResponse(response, [{"type": "message", "role": "user", "content": "hi ✓"}])


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_disk_round_trip_modes_and_atomic_files(tmp_path):
    store = DiskResponseStore(tmp_path, ttl_s=60)

    async def run():
        assert not (tmp_path / "responses").exists()  # nothing until the first write
        rec = _record()
        assert await store.put(rec)
        got = await store.get(rec.id)
        assert got == rec and got.conversation()[-1]["content"][0]["text"] == "hello"
        assert got.conversation()[0]["content"] == "hi ✓"
        path = tmp_path / "responses" / f"{rec.id}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "responses").stat().st_mode) == 0o700
        assert sorted(os.listdir(tmp_path / "responses")) == [f"{rec.id}.json"]  # no temp file left
        assert await store.delete(rec.id) and not path.exists()
        assert await store.get(rec.id) is None and not await store.delete(rec.id)
        await store.close()

    asyncio.run(run())
    assert store.stats.errors == {}


def test_disk_ids_never_become_paths(tmp_path):
    store = DiskResponseStore(tmp_path / "kv", ttl_s=60)
    (tmp_path / "secret.json").write_text("{}")

    async def run():
        for bad in ("../secret", "resp_../../secret", "resp_" + "A" * 32, "", "resp_" + "0" * 31):
            assert await store.get(bad) is None and not await store.delete(bad)
        with pytest.raises(ValueError):
            await store.put(StoredResponse({"id": "../x", "output": []}, []))

    asyncio.run(run())
    assert (tmp_path / "secret.json").exists() and not (tmp_path / "kv").exists()


def test_disk_expiry_and_sweep(tmp_path):
    clock = Clock()
    store = DiskResponseStore(tmp_path, ttl_s=100, sweep_interval_s=10, clock=clock)

    async def run():
        old, fresh = _record("old"), _record("fresh")
        assert await store.put(old)
        await store.close()  # let the first sweep finish
        path = tmp_path / "responses" / f"{old.id}.json"
        os.utime(path, (clock.now - 150, clock.now - 150))  # written 150 s ago: expired
        stale_tmp = tmp_path / "responses" / f".{old.id}.dead.tmp"
        stale_tmp.write_bytes(b"partial")
        os.utime(stale_tmp, (clock.now - 7200, clock.now - 7200))
        assert await store.put(fresh)  # within the sweep interval: no sweep yet
        await store.close()
        assert path.exists() and stale_tmp.exists()
        assert await store.get(old.id) is None and not path.exists()  # an expired read removes the file
        os.utime(tmp_path / "responses" / f"{fresh.id}.json", (clock.now - 150, clock.now - 150))
        clock.now += 11
        assert await store.put(_record("newest"))  # the interval passed: a sweep runs in the background
        await store.close()
        names = os.listdir(tmp_path / "responses")
        assert len(names) == 1 and names[0].endswith(".json") and fresh.id not in names[0]
        assert store.swept == 2

    asyncio.run(run())


def test_disk_corrupt_record_is_removed(tmp_path, caplog):
    store = DiskResponseStore(tmp_path, ttl_s=60)

    async def run():
        rec = _record()
        assert await store.put(rec)
        (tmp_path / "responses" / f"{rec.id}.json").write_bytes(b'{"v": 1, "response": [')
        assert await store.get(rec.id) is None
        assert not (tmp_path / "responses" / f"{rec.id}.json").exists()

    asyncio.run(run())
    assert store.stats.errors["corrupt"] == 1
    assert any("not a valid record" in r.getMessage() for r in caplog.records)


def test_disk_that_cannot_be_written_fails_softly_and_logs_once(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    store = DiskResponseStore(tmp_path / "file", ttl_s=60)  # <file>/responses cannot be created

    async def run():
        assert not await store.put(_record())
        assert not await store.put(_record())
        assert await store.get(f"resp_{uuid.uuid4().hex}") is None

    caplog.set_level(logging.WARNING, logger="flashtier.server.response_store.store")
    asyncio.run(run())
    assert store.stats.errors["put"] == 2
    assert len([r for r in caplog.records if "is failing" in r.getMessage()]) == 1


def test_redis_keys_ttl_and_an_outage(caplog):
    caplog.set_level(logging.WARNING, logger="flashtier.server.response_store.store")
    with RedisServer() as redis_server:
        admin = redis_server.client()
        store = RedisResponseStore(redis_server.url, ttl_s=30, timeout_s=0.5)

        async def run():
            rec = _record()
            assert await store.put(rec)
            assert 0 < admin.pttl(f"ft:resp:{rec.id}") <= 30_000
            assert await store.get(rec.id) == rec
            admin.set(f"ft:resp:{rec.id}", b"garbage")
            assert await store.get(rec.id) is None and store.stats.errors["corrupt"] == 1
            assert await store.delete(rec.id) and not await store.delete(rec.id)
            assert await store.get("resp_not-an-id") is None
            redis_server.stop()
            assert not await store.put(_record())  # refused: counted, logged, no exception
            assert await store.get(rec.id) is None
            redis_server.start(port=redis_server.port)
            await asyncio.sleep(1.1)  # the breaker's first back-off
            again = _record("back")
            assert await store.put(again) and await store.get(again.id) == again
            await store.close()

        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "is failing" in m]) == 1
    assert len([m for m in messages if "works again" in m]) == 1
    assert store.stats.errors["put"] >= 1


def test_redis_ttl_expires_records():
    with RedisServer() as redis_server:
        store = RedisResponseStore(redis_server.url, ttl_s=0.2)

        async def run():
            rec = _record()
            assert await store.put(rec) and await store.get(rec.id) == rec
            await asyncio.sleep(0.35)
            assert await store.get(rec.id) is None
            await store.close()

        asyncio.run(run())


def test_memory_store_expiry_and_bound():
    store = MemoryResponseStore(ttl_s=0.1, max_entries=2)

    async def run():
        a, b, c = _record("a"), _record("b"), _record("c")
        for rec in (a, b, c):
            assert await store.put(rec)
        assert await store.get(a.id) is None and await store.get(c.id) == c  # the oldest went first
        await asyncio.sleep(0.15)
        assert await store.get(c.id) is None

    asyncio.run(run())


def test_the_settings_choose_the_backend(tmp_path):
    assert isinstance(open_response_store(build_settings(None, {}, kv_dir=str(tmp_path))), DiskResponseStore)
    assert isinstance(open_response_store(build_settings(None, {}, kv_persist=False)), MemoryResponseStore)
    redis = open_response_store(build_settings(None, {}, kv_dir=str(tmp_path), redis_url="redis://127.0.0.1:1/0",
                                               response_store_ttl_s=90.0))
    assert isinstance(redis, RedisResponseStore) and redis.ttl_s == 90.0
    settings = build_settings(None, {"FLASHTIER_RESPONSE_STORE_TTL": "2h"})
    assert settings.response_store_ttl_s == 7200.0
    assert build_settings(None, {}).response_store_ttl_s == 24 * 3600.0
    with pytest.raises(ValueError, match="FLASHTIER_RESPONSE_STORE_TTL"):
        build_settings(None, {"FLASHTIER_RESPONSE_STORE_TTL": "0"})


# ---- through live servers -----------------------------------------------------------------------------


def test_ttl_expiry(tokenizer, tmp_path):
    with run_server(tokenizer, kv_dir=str(tmp_path), response_store_ttl_s=1.0) as server:
        client = server.openai()
        r = client.responses.create(model=server.settings.model_name, input="short-lived")
        assert client.responses.retrieve(r.id).id == r.id
        time.sleep(1.2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=server.settings.model_name, input="x", previous_response_id=r.id)
        assert not (tmp_path / "responses" / f"{r.id}.json").exists()  # the expired read removed it


def _two_turns_across_a_restart(tokenizer, **settings) -> None:
    with run_server(tokenizer, **settings) as server:
        r1 = server.openai().responses.create(model=server.settings.model_name, input="Remember: blue.")
    with run_server(tokenizer, **settings) as server:  # a new process-equivalent: nothing in memory
        client = server.openai()
        assert client.responses.retrieve(r1.id).output_text == DEFAULT_REPLY
        client.responses.create(model=server.settings.model_name, input="Which colour?", previous_response_id=r1.id)
        expected = [{"role": "user", "content": "Remember: blue."}, {"role": "assistant", "content": DEFAULT_REPLY},
                    {"role": "user", "content": "Which colour?"}]
        assert list(server.engine.calls[-1].prompt_token_ids) == encode_to_ids(tokenizer, expected)


def test_previous_response_id_survives_a_restart_on_disk(tokenizer, tmp_path):
    _two_turns_across_a_restart(tokenizer, kv_dir=str(tmp_path))
    assert len(list((tmp_path / "responses").glob("resp_*.json"))) == 2


def test_previous_response_id_survives_a_restart_in_redis(tokenizer, tmp_path):
    with RedisServer() as redis_server:
        _two_turns_across_a_restart(tokenizer, redis_url=redis_server.url, kv_dir=str(tmp_path),
                                    response_store_ttl_s=600.0)
        admin = redis_server.client()
        keys = admin.keys("ft:resp:resp_*")
        assert len(keys) == 2 and all(0 < admin.pttl(k) <= 600_000 for k in keys)
    assert not (tmp_path / "responses").exists()  # Redis, not the disk, held them


def test_a_dead_redis_does_not_fail_the_request(tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="flashtier.server.response_store.store")
    with run_server(tokenizer, redis_url=f"redis://127.0.0.1:{free_port()}/0") as server:
        client = server.openai()
        r = client.responses.create(model=server.settings.model_name, input="hi")
        r2 = client.responses.create(model=server.settings.model_name, input="hi")
        assert r.output_text == r2.output_text == DEFAULT_REPLY
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=server.settings.model_name, input="x", previous_response_id=r.id)
    failing = [rec for rec in caplog.records if "is failing" in rec.getMessage()]
    assert len(failing) == 1


@pytest.mark.parametrize("isolation", ["per-key", "shared"])
def test_per_key_isolation_scopes_stored_responses(tokenizer, tmp_path, isolation):
    with run_server(tokenizer, kv_dir=str(tmp_path), api_key=("key-a", "key-b"), cache_isolation=isolation) as server:
        a, b = server.openai(api_key="key-a"), server.openai(api_key="key-b")
        r = a.responses.create(model=server.settings.model_name, input="mine")
        if isolation == "shared":  # the contrast: any key reads any response
            assert b.responses.retrieve(r.id).id == r.id
            return
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=server.settings.model_name, input="x", previous_response_id=r.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=server.settings.model_name,
                               input=[{"type": "item_reference", "id": r.output[0].id}])
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(r.id)
        assert a.responses.retrieve(r.id).output_text == DEFAULT_REPLY  # still there for its owner
        a.responses.create(model=server.settings.model_name, input="next", previous_response_id=r.id)
        assert "mine" in tokenizer.decode(server.engine.calls[-1].prompt_token_ids)
