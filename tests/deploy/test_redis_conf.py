"""deploy/redis/redis.conf in a real redis-server, started as compose starts it (the file, then --maxmemory),
with only the address and the working directory moved to a free loopback port and a temporary directory.

It must load, keep nothing on disk, and evict the way the snapshot pool needs under a full ``maxmemory``:
keys with a TTL (every snapshot is ``SET ... PX``) go, least recently used first, and writes keep succeeding;
a key without a TTL is never evicted.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from ..kvstore.redis_server import free_port
from .promql_queries import DEPLOY


@pytest.fixture
def conf_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found on PATH: install it (Debian/Ubuntu: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, str(DEPLOY / "redis" / "redis.conf"), "--maxmemory", "4mb", "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.02)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        proc.stderr.close()


def test_the_config_loads_without_persistence_and_with_volatile_eviction(conf_server):
    config = conf_server.config_get("*")
    assert config["save"] == "" and config["appendonly"] == "no"
    assert config["maxmemory-policy"] == "volatile-lru"
    assert int(config["maxmemory"]) == 4 << 20  # the compose override wins over the file's 16gb
    assert "maxmemory 16gb" in (DEPLOY / "redis" / "redis.conf").read_text()


def test_snapshots_are_evicted_and_writes_go_on_at_maxmemory(conf_server):
    conf_server.set("pinned", b"x" * 1000)  # no TTL: a volatile policy never evicts it
    value = b"s" * 64 * 1024
    for i in range(400):  # 25 MB of snapshots into 4 MB
        assert conf_server.set(f"ft:snap:{i}", value, px=300_000)
    stats = conf_server.info("stats")
    assert stats["evicted_keys"] > 300
    assert conf_server.get("pinned") == b"x" * 1000
    assert conf_server.exists("ft:snap:399") and not conf_server.exists("ft:snap:0")
