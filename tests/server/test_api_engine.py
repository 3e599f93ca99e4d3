"""The HTTP API in front of the real engine (tiny demo weights, fp32) with the official openai SDK:
chat and completions, streaming usage, n = 2, seeds, stop strings, logprobs, and a disconnect that
frees the request's blocks."""

from __future__ import annotations

import time

import httpx
import pytest

from flashtier.engine.config import EngineConfig
from flashtier.kvstore.config import KVStoreConfig

from .conftest import run_server
from .engine_core_support import tiny_engine_core

MODEL = "flashtier-tiny"


@pytest.fixture(scope="module")
def real(tokenizer):
    client = tiny_engine_core(EngineConfig(max_num_batched_tokens=256), KVStoreConfig(block_size=16, num_blocks=400))
    with run_server(tokenizer, client) as server:
        yield server


def test_chat_stream_usage_n2_and_seed(real):
    client = real.openai()
    msgs = [{"role": "user", "content": "Write something."}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.8, seed=7, n=2)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0.8, seed=7, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2 and a.usage.completion_tokens == 12
    assert a.choices[0].message.content != a.choices[1].message.content  # per-choice seeds differ
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert text == greedy.choices[0].message.content and usage.completion_tokens == 6
    assert greedy.usage.prompt_tokens_details.cached_tokens == 0  # a 10-token prompt has no full block


def test_completions_logprobs_and_stop(real):
    client = real.openai()
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs) == 5 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    text = out.choices[0].text
    stop = text[2:5]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]


def test_disconnect_mid_stream_frees_the_blocks(real):
    """Read through the engine core's stats (it lives in its own process): no request left, no block in use."""
    engine = real.engine
    body = {"model": MODEL, "prompt": "tell me everything " * 20, "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", real.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # the client goes away mid-stream
    def busy(stats) -> bool:
        return bool(stats.num_running or stats.num_waiting or stats.kv_usage)

    deadline = time.monotonic() + 60  # the abort is one engine step away; the bound only stops a hang
    while busy(engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert not busy(stats), stats
    assert stats.generation_tokens > 6  # the stream did decode before it was dropped
