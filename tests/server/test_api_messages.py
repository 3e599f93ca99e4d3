"""/v1/messages and /v1/messages/count_tokens through the official ``anthropic`` SDK (and raw HTTP where the
SDK hides the wire: event names, ping, error bodies) against a live server and a scripted engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import anthropic
import httpx
import pytest

from flashtier.server.text.chat_encoding import REASONING_EFFORT_LINE, encode_to_ids
from flashtier.server.text.dsml_markup import render_tool_calls

from .conftest import DEFAULT_REPLY, run_server

USER = [{"role": "user", "content": "Say hello."}]
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                      "required": ["city"]}},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}},
]


def _calls_text(*calls) -> str:
    return "\n\n" + render_tool_calls(calls)


def _client(server, **kwargs) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", server.api_key)
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=30, **kwargs)


def _create(server, **fields):
    fields.setdefault("model", server.settings.model_name)
    fields.setdefault("max_tokens", 256)
    fields.setdefault("messages", USER)
    return _client(server).messages.create(**fields)


def _raw_events(server, body: dict, path: str = "/v1/messages") -> list[tuple[str, dict]]:
    """(event name, data) of a streamed response, read off the wire."""
    with server.http() as http:
        r = http.post(path, json={"model": server.settings.model_name, "max_tokens": 256, "messages": USER,
                                  **body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert "[DONE]" not in r.text
    events = []
    for frame in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def _prompt(server, index: int = -1) -> str:
    return server.tokenizer.decode(server.engine.calls[index].prompt_token_ids)


def test_non_streaming_text(server):
    r = _create(server)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == server.settings.model_name
    assert [(b.type, b.text) for b in r.content] == [("text", DEFAULT_REPLY)]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    (call,) = server.engine.calls
    assert list(call.prompt_token_ids) == encode_to_ids(server.tokenizer, USER)
    assert call.params.max_tokens == 256
    assert r.usage.input_tokens == len(call.prompt_token_ids)
    assert r.usage.output_tokens == len(server.encode(DEFAULT_REPLY))
    assert r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens == 0


def test_streaming_text_equals_the_non_streamed_message(server):
    plain = _create(server)
    with _client(server).messages.stream(model=server.settings.model_name, max_tokens=256, messages=USER) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    names = [name for name, _ in _raw_events(server, {})]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_thinking_blocks(server):
    server.engine.script = server.script("Let me think. 2+2=4.</think>The answer is 4.")
    r = _create(server, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Let me think. 2+2=4." and r.content[0].signature
    assert r.content[1].text == "The answer is 4."
    assert _prompt(server).endswith("<｜Assistant｜><think>")
    events = _raw_events(server, {"thinking": {"type": "adaptive"}})
    thinking = [d["delta"] for n, d in events if n == "content_block_delta" and d["index"] == 0]
    assert "".join(d.get("thinking", "") for d in thinking) == "Let me think. 2+2=4."
    assert thinking[-1]["type"] == "signature_delta" and thinking[-1]["signature"]
    stops = [(i, n) for i, (n, d) in enumerate(events) if n == "content_block_stop"]
    assert [events[i][1]["index"] for i, _ in stops] == [0, 1]
    with _client(server).messages.stream(model=server.settings.model_name, max_tokens=256, messages=USER,
                                         thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    _create(server, thinking={"type": "disabled"})
    assert _prompt(server).endswith("<｜Assistant｜></think>")


def test_effort_sets_the_reasoning_level(server):
    _create(server, thinking={"type": "enabled", "budget_tokens": 2000}, output_config={"effort": "max"})
    assert REASONING_EFFORT_LINE.format(n=100) in _prompt(server)
    _create(server, thinking={"type": "enabled", "budget_tokens": 2000}, output_config={"effort": "low"})
    assert REASONING_EFFORT_LINE.format(n=50) in _prompt(server)


def test_tool_use_then_tool_result_round_trip(server):
    text = "Need the weather.</think>" + _calls_text(("get_weather", {"city": "Oslo", "days": 2}))
    server.engine.script = server.script(text)
    client = _client(server)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    r = client.messages.create(model=server.settings.model_name, max_tokens=256, messages=USER, tools=TOOLS,
                               thinking=thinking)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    use = r.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Oslo", "days": 2}
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "sunny, 20C"}]}]}]
    server.engine.script = server.script("Got it.</think>It is sunny.")
    r2 = client.messages.create(model=server.settings.model_name, max_tokens=256, messages=history, tools=TOOLS,
                                thinking=thinking)
    assert [b.type for b in r2.content] == ["thinking", "text"] and r2.content[1].text == "It is sunny."
    assert r2.stop_reason == "end_turn"
    p1, p2 = (c.prompt_token_ids for c in server.engine.calls)
    assert "<tool_result>sunny, 20C</tool_result>" in server.tokenizer.decode(p2)
    # the history renders as the first prompt + what was generated: the prefix cache is hit
    generated = tuple(server.encode(text) + [server.tokenizer.eos_id])
    assert p2[: len(p1) + len(generated)] == tuple(p1) + generated
    assert r2.usage.cache_read_input_tokens > 0
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == len(p2)


def test_streaming_tool_use_assembles_the_same_input(server):
    calls = (("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Europe/Paris"}))
    server.engine.script = server.script("Checking." + _calls_text(*calls))
    plain = _create(server, tools=TOOLS)
    assert plain.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None)) for b in plain.content] == [
        ("text", None), ("tool_use", "get_weather"), ("tool_use", "get_time")]
    events = _raw_events(server, {"tools": TOOLS})
    starts = {d["index"]: d["content_block"] for n, d in events if n == "content_block_start"}
    assert list(starts) == [0, 1, 2] and starts[1]["input"] == {} and starts[1]["id"].startswith("toolu_")
    for index, (name, args) in zip((1, 2), calls, strict=True):
        parts = [d["delta"]["partial_json"] for n, d in events
                 if n == "content_block_delta" and d["index"] == index]
        assert starts[index]["name"] == name and json.loads("".join(parts)) == args
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    with _client(server).messages.stream(model=server.settings.model_name, max_tokens=256, messages=USER,
                                         tools=TOOLS) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content[1:]] == [args for _, args in calls]
    assert final.stop_reason == "tool_use"


def test_tool_choice_and_parallel_mapping(server):
    server.engine.script = server.script(_calls_text(("get_weather", {"city": "A"}), ("get_time", {"tz": "B"})))
    r = _create(server, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.name for b in r.content] == ["get_weather"]
    r = _create(server, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in r.content] == ["get_weather", "get_time"]
    r = _create(server, tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as exc:
        _create(server, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "nope" in exc.value.body["error"]["message"]


def test_server_tools_are_ignored(server):
    r = _create(server, tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                               {"type": "bash_20250124", "name": "bash"}])
    assert r.content[0].text == DEFAULT_REPLY
    prompt = _prompt(server)
    assert "get_weather" in prompt and "web_search" not in prompt and '"bash"' not in prompt


def test_tool_result_error_and_text_keep_their_order(server):
    history = [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "boom", "is_error": True},
            {"type": "text", "text": "Try again."}]}]
    _create(server, messages=history, tools=TOOLS)
    assert "<tool_result>Error: boom</tool_result>\n\nTry again.<｜Assistant｜>" in _prompt(server)


def test_count_tokens_equals_the_prompt_the_engine_saw(server):
    body = {"system": "Be brief.", "messages": USER, "tools": TOOLS, "thinking": {"type": "enabled",
                                                                                   "budget_tokens": 1024}}
    _create(server, **body)
    counted = _client(server).messages.count_tokens(model=server.settings.model_name, **body)
    assert counted.input_tokens == len(server.engine.calls[-1].prompt_token_ids) > 0
    assert len(server.engine.calls) == 1  # counting ran no generation
    with pytest.raises(anthropic.NotFoundError):
        _client(server).messages.count_tokens(model="no-such-model", messages=USER)


def test_system_blocks_and_a_stray_system_role(server):
    expected = encode_to_ids(server.tokenizer, [{"role": "system", "content": "Be brief.\n\nAnd kind."}, *USER])
    _create(server, thinking={"type": "disabled"}, system=[
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "And kind."}])
    assert list(server.engine.calls[-1].prompt_token_ids) == expected
    with server.http() as http:
        r = http.post("/v1/messages", json={
            "model": server.settings.model_name, "max_tokens": 16, "thinking": {"type": "disabled"},
            "messages": [{"role": "system", "content": "Be brief.\n\nAnd kind."}, *USER]})
    assert r.status_code == 200, r.text
    assert list(server.engine.calls[-1].prompt_token_ids) == expected
    with server.http() as http:  # found by the schemathesis suite: a tool_use block in a system entry was a 500
        r = http.post("/v1/messages", json={
            "model": server.settings.model_name, "max_tokens": 16,
            "messages": [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                         *USER]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "tool_use block is not allowed here" in r.json()["error"]["message"]


def test_stop_sequences_and_max_tokens(server):
    server.engine.script = server.script("one two STOP three four")
    r = _create(server, stop_sequences=["STOP", "zeta"])
    assert r.content[0].text == "one two " and r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    events = _raw_events(server, {"stop_sequences": ["STOP"]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    r = _create(server, max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    assert server.engine.calls[-1].params.max_tokens == 3


def test_sampling_fields_reach_the_engine(server):
    _create(server, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40}, metadata={"user_id": "u"})
    p = server.engine.calls[-1].params
    assert (p.temperature, p.top_p, p.top_k) == (0.5, 0.9, 40)


def _assert_anthropic_error(r: httpx.Response, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == type_ and body["error"]["message"]
    return body["error"]["message"]


def test_errors_are_in_anthropic_shape(server):
    with server.http() as http:
        msg = _assert_anthropic_error(http.post("/v1/messages", json={"model": server.settings.model_name,
                                                                      "messages": USER}), 400,
                                      "invalid_request_error")
        assert "max_tokens" in msg
        _assert_anthropic_error(http.post("/v1/messages", content=b"{bad"), 400, "invalid_request_error")
        _assert_anthropic_error(http.post("/v1/messages/nope", json={}), 404, "not_found_error")
        _assert_anthropic_error(http.post("/v1/messages", content=b'{"model": "caf\xe9"}'), 400,
                                "invalid_request_error")
        msg = _assert_anthropic_error(http.post("/v1/messages", json={
            "model": server.settings.model_name, "max_tokens": 5, "messages": [*USER, {
                "role": "assistant", "content": "Hel"}]}), 400, "invalid_request_error")
        assert "prefill" in msg
        # the OpenAI routes keep their own shape
        assert set(http.post("/v1/chat/completions", json={}).json()) == {"error"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        _create(server, messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    assert "image" in exc.value.body["error"]["message"] and "not supported" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        _create(server, messages=[{"role": "user", "content": [{"type": "search_result", "source": "s"}]}])
    assert "'search_result'" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as exc:
        _create(server, model="no-such-model")
    assert exc.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as exc:
        _create(server, extra_body={"temperature": 5})
    assert "temperature" in exc.value.body["error"]["message"]
    assert not server.engine.calls


def test_engine_stopping_mid_stream_is_an_error_event(server):
    server.engine.step_delay_s = 0.02
    server.engine.script = server.script("word " * 200)
    with _client(server).messages.stream(model=server.settings.model_name, max_tokens=512, messages=USER) as s:
        with pytest.raises(anthropic.APIStatusError) as exc:
            for event in s:
                if event.type == "content_block_delta":
                    asyncio.run(server.engine.shutdown())
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "overloaded_error"


def test_engine_stopping_mid_message_is_503_overloaded(server):
    server.engine.step_delay_s = 0.02
    server.engine.script = server.script("word " * 200)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_create, server, max_tokens=512)
        assert server.engine.wait_for(lambda e: e.num_active == 1)
        asyncio.run(server.engine.shutdown())
        with pytest.raises(anthropic.ServiceUnavailableError) as exc:
            pending.result(timeout=30)
    assert exc.value.body["error"]["type"] == "overloaded_error"


def test_client_disconnect_aborts_the_engine_request(server):
    server.engine.step_delay_s = 0.02
    server.engine.script = server.script("word " * 500)
    with _client(server).messages.stream(model=server.settings.model_name, max_tokens=1024, messages=USER) as s:
        for event in s:
            if event.type == "content_block_delta":
                break
    assert server.engine.wait_for(lambda e: e.num_active == 0 and len(e.calls) == 1)
    request_id = server.engine.calls[0].request_id
    assert request_id in server.engine.aborted or request_id in server.engine.cancelled


def test_beta_query_and_headers_are_accepted(server):
    r = _client(server).beta.messages.create(model=server.settings.model_name, max_tokens=64, messages=USER,
                                             betas=["interleaved-thinking-2025-05-14"])
    assert r.content[0].text == DEFAULT_REPLY
    with server.http() as http:
        r = http.post("/v1/messages?beta=true", headers={"anthropic-version": "2023-06-01",
                                                          "anthropic-beta": "foo-2025-01-01"},
                      json={"model": server.settings.model_name, "max_tokens": 8, "messages": USER})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"


def test_repeated_prefix_reads_the_cache(server):
    long_user = [{"role": "user", "content": "Remember this list: " + ", ".join(f"item {i}" for i in range(200))}]
    first = _create(server, messages=long_user)
    second = _create(server, messages=long_user)
    total = len(server.engine.calls[-1].prompt_token_ids)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == total
    assert second.usage.cache_read_input_tokens >= 64
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total


def test_root_answers_head_and_get(server):
    with server.http() as http:
        assert http.head("/").status_code == 200
        r = http.get("/")
    assert r.status_code == 200 and r.json() == {"status": "ok", "models": list(server.settings.model_names)}


@pytest.fixture(scope="module")
def keyed_server(tokenizer):
    with run_server(tokenizer, api_key=("k",), max_request_bytes=4096) as srv:
        yield srv


def test_api_keys_x_api_key_and_bearer(keyed_server):
    srv = keyed_server
    with pytest.raises(anthropic.AuthenticationError) as exc:
        _client(srv, api_key="wrong").messages.create(model=srv.settings.model_name, max_tokens=8, messages=USER)
    assert exc.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "Incorrect API key provided"}}
    _assert_anthropic_error(httpx.post(srv.url + "/v1/messages/count_tokens", json={}), 401, "authentication_error")
    assert _create(srv).content[0].text == DEFAULT_REPLY  # x-api-key
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token="k", max_retries=0)
    assert bearer.messages.create(model=srv.settings.model_name, max_tokens=8, messages=USER).stop_reason
    chat = {"messages": USER}
    assert httpx.post(srv.url + "/v1/chat/completions", json=chat, headers={"x-api-key": "k"}).status_code == 200
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "k"},
                   json={"model": srv.settings.model_name, "max_tokens": 8, "messages": USER, "pad": "x" * 5000})
    _assert_anthropic_error(r, 413, "request_too_large")
