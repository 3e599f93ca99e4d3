"""The port opens before the engine is built: /health answers 503 naming the phase (loading, warming up),
/metrics is served throughout with ``flashtier_engine_starting``, and a factory that fails stops the server
through ``on_fatal`` with the cause in /health. Every wait is on an event the test controls, never a timer."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from flashtier.server.app import create_app
from flashtier.server.config.settings import build_settings

from .conftest import default_engine

WAIT_S = 30


@contextmanager
def serving(tokenizer, factory, on_fatal=None):
    """uvicorn on a loopback port around ``create_app(factory)``; yields (url, state) once the port is open."""
    app = create_app(build_settings(None, {}, kv_persist=False), factory, tokenizer=tokenizer, on_fatal=on_fatal)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=5) as http:
        # uvicorn sets `started` once the lifespan has yielded, which no longer waits for the engine; the loop
        # only bounds how long to wait for it (as tests/server/conftest.py's run_server)
        deadline = time.monotonic() + WAIT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the port did not open"
            time.sleep(0.02)
        try:
            yield http, app.state.flashtier
        finally:
            server.should_exit = True
            thread.join(15)
            sock.close()


def _starting(http) -> float:
    line = next(l for l in http.get("/metrics").text.splitlines() if l.startswith("flashtier_engine_starting{"))
    return float(line.rsplit(" ", 1)[1])


def test_health_names_each_phase_until_ready(tokenizer):
    engine = default_engine(tokenizer)
    load, warm, release_load, release_warm = (threading.Event() for _ in range(4))

    def factory(settings, *, phase):
        load.set()
        assert release_load.wait(WAIT_S)
        phase("warming up")
        warm.set()
        assert release_warm.wait(WAIT_S)
        return engine

    with serving(tokenizer, factory) as (http, state):
        assert load.wait(WAIT_S)
        r = http.get("/health")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert _starting(http) == 1.0 and "flashtier_engine_ready{" in http.get("/metrics").text
        release_load.set()
        assert warm.wait(WAIT_S)
        r = http.get("/health")
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 503
        release_warm.set()
        assert state.ready.wait(WAIT_S)
        assert http.get("/health").json() == {"status": "ok"} and _starting(http) == 0.0
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_factory_that_fails_stops_the_server_with_its_cause(tokenizer):
    fatal = threading.Event()

    def factory(settings):
        raise RuntimeError("no such checkpoint shard: model-00003.safetensors")

    with serving(tokenizer, factory, on_fatal=fatal.set) as (http, state):
        assert fatal.wait(WAIT_S)
        r = http.get("/health")
        assert r.status_code == 503 and "model-00003.safetensors" in r.json()["error"]["message"]
        assert not state.ready.is_set() and _starting(http) == 0.0  # failed: not "starting" (alerts tell them apart)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_factory_kinds_serve(tokenizer, kind):
    engine = default_engine(tokenizer)

    async def async_factory(settings):
        return engine

    with serving(tokenizer, (lambda s: engine) if kind == "sync" else async_factory) as (http, state):
        assert state.ready.wait(WAIT_S) and http.get("/health").status_code == 200
