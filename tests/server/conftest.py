"""A real uvicorn server on a loopback port, in a thread, in front of a ScriptedEngineClient.

``live_server`` (one per session) is what most API tests use through the ``server`` fixture, which
restores the scripted engine's defaults before each test. ``run_server`` starts further servers
with other settings (API keys, small body limits).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from flashtier.server.app import create_app
from flashtier.server.config.settings import ServerSettings, build_settings
from flashtier.server.text.tokenizer import Tokenizer
from .scripted_engine import ScriptedEngineClient

DEFAULT_REPLY = "Hello from the scripted engine."
MAX_MODEL_LEN = 8192


@dataclass
class LiveServer:
    url: str
    engine: ScriptedEngineClient
    tokenizer: Tokenizer
    settings: ServerSettings
    api_key: str = "unused"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def openai(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 30)
        return openai.OpenAI(base_url=self.base_url, **kwargs)

    def async_openai(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 30)
        return openai.AsyncOpenAI(base_url=self.base_url, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Script tokens for `text` (control-token text becomes control tokens, as the model writes them)."""
        return self.tokenizer.encode(text, allow_special=True)

    def script(self, text: str, eos: bool = True) -> list[int]:
        return self.encode(text) + ([self.tokenizer.eos_id] if eos else [])

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (sample name, sorted labels without model_name)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out


def default_engine(tokenizer: Tokenizer) -> ScriptedEngineClient:
    return ScriptedEngineClient(tokenizer.encode(DEFAULT_REPLY) + [tokenizer.eos_id], eos_token_id=tokenizer.eos_id,
                                max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size)


def restore_defaults(engine: ScriptedEngineClient, tokenizer: Tokenizer) -> None:
    fresh = default_engine(tokenizer)
    engine.script = fresh.script
    engine.max_model_len = MAX_MODEL_LEN
    engine.tokens_per_step = 1
    engine.step_delay_s = 0.0
    engine.max_active = None
    engine.ready = True
    engine.tier_stats = {}
    engine.reset()


@contextmanager
def run_server(tokenizer: Tokenizer, engine: ScriptedEngineClient | None = None,
               **overrides) -> Iterator[LiveServer]:
    engine = engine or default_engine(tokenizer)
    if "kv_dir" not in overrides and "kv_persist" not in overrides:
        overrides["kv_persist"] = False  # nothing under the user's cache dir (the response store stays in memory)
    settings = build_settings(None, {}, **overrides)
    app = create_app(settings, lambda s: engine, tokenizer=tokenizer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    # the port opens before the engine is built (app.py): wait for the engine on its event, not on a timer
    if not app.state.flashtier.ready.wait(20):
        raise RuntimeError(f"the test server's engine did not start: {app.state.flashtier.phase}")
    try:
        keys = settings.api_key
        yield LiveServer(f"http://127.0.0.1:{port}", engine, tokenizer, settings,
                         api_key=keys[0] if keys else "unused")
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer()


@pytest.fixture(scope="session")
def live_server(tokenizer) -> Iterator[LiveServer]:
    with run_server(tokenizer) as server:
        yield server


@pytest.fixture
def server(live_server) -> Iterator[LiveServer]:
    restore_defaults(live_server.engine, live_server.tokenizer)
    yield live_server
    restore_defaults(live_server.engine, live_server.tokenizer)
