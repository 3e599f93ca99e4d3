"""Client disconnects abort the engine request; 32 concurrent streams; metrics agree with what was sent."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from flashtier.server.serving.metrics import (
    E2E,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_SUCCESS,
    TTFT,
)

USER = [{"role": "user", "content": "Tell me a long story."}]


def _long_script(server, n: int = 400) -> list[int]:
    return server.encode(" ".join(f"word{i}" for i in range(n))) + [server.tokenizer.eos_id]


def test_streaming_disconnect_aborts(server):
    server.engine.script = _long_script(server)
    server.engine.step_delay_s = 0.01
    client = server.openai()
    stream = client.chat.completions.create(model=server.settings.model_name, messages=USER, stream=True)
    received = 0
    for chunk in stream:
        received += 1
        if received == 5:
            break
    stream.close()  # closes the HTTP connection mid-stream
    assert server.engine.wait_for(lambda e: len(e.aborted) == 1, timeout=5)
    (call,) = server.engine.calls
    assert server.engine.aborted == [call.request_id]
    assert server.engine.wait_for(lambda e: e.num_active == 0, timeout=5)
    assert server.engine.cancelled == [call.request_id]


def _raw_request(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_aborts(server, stream):
    server.engine.script = _long_script(server)
    server.engine.step_delay_s = 0.05
    port = int(server.url.rsplit(":", 1)[1])
    sock = _raw_request(port, {"messages": USER, "stream": stream})
    assert server.engine.wait_for(lambda e: len(e.calls) == 1 and e.num_active == 1, timeout=5)
    sock.close()
    assert server.engine.wait_for(lambda e: len(e.aborted) == 1, timeout=5)
    assert server.engine.aborted == [server.engine.calls[0].request_id]
    assert server.engine.wait_for(lambda e: e.num_active == 0, timeout=5)


def test_non_streaming_disconnect_mid_generation_aborts(server):
    server.engine.script = _long_script(server)
    server.engine.step_delay_s = 0.01
    port = int(server.url.rsplit(":", 1)[1])
    sock = _raw_request(port, {"messages": USER})
    assert server.engine.wait_for(lambda e: len(e.calls) == 1, timeout=5)
    import time

    time.sleep(0.2)  # some tokens are generated
    sock.close()
    assert server.engine.wait_for(lambda e: len(e.aborted) == 1, timeout=5)
    assert server.engine.wait_for(lambda e: e.num_active == 0, timeout=5)
    m = server.metrics()
    assert m[(REQUEST_SUCCESS + "_total", (("finished_reason", "abort"),))] >= 1


def _delta(after: dict, before: dict, key) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_32_concurrent_streams_and_metrics_agree(server):
    server.engine.step_delay_s = 0.002
    server.engine.script = lambda prompt, params: _long_script(server, 20 + prompt[-3] % 17)
    before = server.metrics()

    async def one(client, i: int):
        stream = await client.chat.completions.create(
            model=server.settings.model_name, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"request {i}: " + "pad " * i}])
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, usage, finish

    async def main():
        client = server.async_openai()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32
    calls = {c.request_id: c for c in server.engine.calls}
    assert len(calls) == 32
    for text, usage, finish in results:
        assert finish == "stop" and text.startswith("word0 word1")
        assert usage.completion_tokens == len(server.encode(text))
    sent_prompt = sum(u.prompt_tokens for _, u, _ in results)
    sent_generated = sum(u.completion_tokens for _, u, _ in results)
    assert sent_prompt == sum(len(c.prompt_token_ids) for c in calls.values())
    after = server.metrics()
    stop = (REQUEST_SUCCESS + "_total", (("finished_reason", "stop"),))
    assert _delta(after, before, stop) == 32
    assert _delta(after, before, (TTFT + "_count", ())) == 32
    assert _delta(after, before, (E2E + "_count", ())) == 32
    assert _delta(after, before, (REQUEST_PROMPT_TOKENS + "_sum", ())) == sent_prompt
    assert _delta(after, before, (REQUEST_GENERATION_TOKENS + "_sum", ())) == sent_generated
    assert _delta(after, before, (PROMPT_TOKENS + "_total", ())) == sent_prompt
    assert _delta(after, before, (GENERATION_TOKENS + "_total", ())) == sent_generated
    assert _delta(after, before, ("flashtier_prefix_cache_queries_total", ())) == sent_prompt
    assert after[("flashtier_num_requests_running", ())] == 0
