"""/v1/responses through the openai SDK (and raw HTTP) against a live server and a scripted engine.

The module's server keeps its response store in a temporary KV directory (restart, Redis and TTL tests
are in test_response_store.py, the Agents SDK in test_api_responses_agents.py). The prompt the engine
received is compared with chat's encoding, so each test shows what the translation rendered, not only
that a request went through.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from flashtier.server.text.chat_encoding import REASONING_EFFORT_LINE, encode_to_ids
from flashtier.server.text.dsml_markup import render_tool_calls

from .conftest import DEFAULT_REPLY, LiveServer, restore_defaults, run_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def module_server(tokenizer, tmp_path_factory) -> Iterator[LiveServer]:
    with run_server(tokenizer, kv_dir=str(tmp_path_factory.mktemp("kv"))) as server:
        yield server


@pytest.fixture
def server(module_server) -> Iterator[LiveServer]:
    restore_defaults(module_server.engine, module_server.tokenizer)
    yield module_server
    restore_defaults(module_server.engine, module_server.tokenizer)


def _prompt(server: LiveServer, k: int = -1) -> str:
    return server.tokenizer.decode(server.engine.calls[k].prompt_token_ids)


def _calls_text(*calls) -> str:
    return "\n\n" + render_tool_calls(calls)


def _sse(server: LiveServer, body: dict) -> list[dict]:
    """The raw events of a streamed request: each `event:` name must equal its data's `type`."""
    with server.http() as http:
        r = http.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append(data)
    assert "[DONE]" not in r.text
    return events


def _check_events(events: list[dict]) -> None:
    """Numbering and shapes: every event validates as the SDK's type, sequence numbers count from 0."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)
    for e in (events[0], events[-1]):
        Response.model_validate(e["response"])


def test_text_response(server):
    r = server.openai().responses.create(model=server.settings.model_name, input="Say hello.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == DEFAULT_REPLY
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    (call,) = server.engine.calls
    assert list(call.prompt_token_ids) == encode_to_ids(server.tokenizer, [{"role": "user", "content": "Say hello."}])
    u = r.usage
    assert u.input_tokens == len(call.prompt_token_ids) and u.output_tokens == len(server.encode(DEFAULT_REPLY))
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.incomplete_details is None and r.error is None and r.store is True


def test_instructions_and_message_items(server):
    r = server.openai().responses.create(
        model=server.settings.model_name, instructions="Be brief.", metadata={"ticket": "42"},
        input=[{"role": "developer", "content": "rules"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                {"type": "input_text", "text": "b"}]}])
    expected = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "rules"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert list(server.engine.calls[0].prompt_token_ids) == encode_to_ids(server.tokenizer, expected)
    assert r.instructions == "Be brief." and r.metadata == {"ticket": "42"}


def test_streaming_events_match_the_body(server):
    client = server.openai()
    body = client.responses.create(model=server.settings.model_name, input="Say hello.")
    with client.responses.stream(model=server.settings.model_name, input="Say hello.") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert kinds.count("response.output_text.delta") == len(server.encode(DEFAULT_REPLY))
    assert final.output_text == body.output_text == DEFAULT_REPLY
    def shape(r):
        return [(o.type, o.role, o.status, [(c.type, c.text) for c in o.content]) for o in r.output]
    assert shape(final) == shape(body) == [("message", "assistant", "completed", [("output_text", DEFAULT_REPLY)])]
    assert final.usage.output_tokens == body.usage.output_tokens
    events = _sse(server, {"input": "Say hello."})
    _check_events(events)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == DEFAULT_REPLY
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == DEFAULT_REPLY


def test_reasoning_item_with_thinking(server):
    server.engine.script = server.script("Let me think.</think>The answer is 4.")
    client = server.openai()
    r = client.responses.create(model=server.settings.model_name, input="2+2?", reasoning={"effort": "medium"})
    rs, msg = r.output
    assert rs.type == "reasoning" and rs.id.startswith("rs_") and rs.summary == []
    assert [c.text for c in rs.content] == ["Let me think."] and rs.encrypted_content is None
    assert r.output_text == "The answer is 4."
    assert r.usage.output_tokens_details.reasoning_tokens == len(server.encode("Let me think."))
    assert REASONING_EFFORT_LINE.format(n=75) in _prompt(server) and _prompt(server).endswith("<think>")
    events = _sse(server, {"input": "2+2?", "reasoning": {"effort": "high"}})
    _check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Let me think."
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]


def test_encrypted_reasoning_carries_the_reasoning_back(server):
    text = "Let me think.</think>Four."
    server.engine.script = server.script(text)
    client = server.openai()
    r = client.responses.create(model=server.settings.model_name, input="2+2?", reasoning={"effort": "high"},
                                include=["reasoning.encrypted_content"], store=False)
    rs = r.output[0]
    assert rs.encrypted_content
    # a client that keeps nothing but the opaque blob (Codex with store=false) gets the same prompt
    opaque = {"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content}
    history = [{"role": "user", "content": "2+2?"}, opaque, r.output[1].model_dump(), {"role": "user", "content": "x"}]
    client.responses.create(model=server.settings.model_name, input=history, reasoning={"effort": "high"})
    p1, p2 = (c.prompt_token_ids for c in server.engine.calls)
    generated = tuple(server.encode(text)) + (server.tokenizer.eos_id,)
    assert p2[: len(p1) + len(generated)] == tuple(p1) + generated


def test_function_call_round_trip(server):
    text = "Checking." + _calls_text(("get_weather", {"city": "Paris"}))
    server.engine.script = server.script(text)
    client = server.openai()
    first_input = [{"role": "user", "content": "Weather in Paris? " * 10}]
    r = client.responses.create(model=server.settings.model_name, input=first_input, tools=[WEATHER])
    assert r.status == "completed"
    msg, call = r.output
    assert msg.type == "message" and msg.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert "## Tools" in _prompt(server) and "get_weather" in _prompt(server)
    server.engine.script = server.script("It is sunny.")
    second_input = [*first_input, *(o.model_dump(exclude_none=True) for o in r.output),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}]
    r2 = client.responses.create(model=server.settings.model_name, input=second_input, tools=[WEATHER])
    assert r2.output_text == "It is sunny."
    assert "<tool_result>sunny, 21C</tool_result>" in _prompt(server)
    p1, p2 = (c.prompt_token_ids for c in server.engine.calls)
    generated = tuple(server.encode(text)) + (server.tokenizer.eos_id,)
    assert p2[: len(p1) + len(generated)] == tuple(p1) + generated  # one assistant turn, as written
    assert r2.usage.input_tokens_details.cached_tokens == (len(p1) + len(generated) - 1) // 64 * 64 > 0


def test_streamed_function_call(server):
    server.engine.script = server.script(_calls_text(("get_weather", {"city": "Oslo"})))
    events = _sse(server, {"input": "Weather?", "tools": [WEATHER]})
    _check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = events[-2]["item"]
    assert done["type"] == "function_call" and json.loads(done["arguments"]) == {"city": "Oslo"}
    with server.openai().responses.stream(model=server.settings.model_name, input="Weather?",
                                          tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [("function_call", "get_weather",
                                                                                  {"city": "Oslo"})]


def test_previous_response_id_chain(server):
    client = server.openai()
    r1 = client.responses.create(model=server.settings.model_name, instructions="Be terse.", input="My name is Ada.")
    r2 = client.responses.create(model=server.settings.model_name, input="What is my name?",
                                 previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id and r2.instructions is None
    expected = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": DEFAULT_REPLY},
                {"role": "user", "content": "What is my name?"}]
    assert list(server.engine.calls[1].prompt_token_ids) == encode_to_ids(server.tokenizer, expected)
    assert "Be terse." in _prompt(server, 0) and "Be terse." not in _prompt(server, 1)  # not inherited
    r3 = client.responses.create(model=server.settings.model_name, input="And again?", previous_response_id=r2.id)
    assert "My name is Ada." in _prompt(server) and "What is my name?" in _prompt(server)
    assert client.responses.retrieve(r3.id).output_text == DEFAULT_REPLY


def test_tool_output_through_previous_response_id(server):
    server.engine.script = server.script(_calls_text(("get_weather", {"city": "Rome"})))
    client = server.openai()
    r1 = client.responses.create(model=server.settings.model_name, input="Weather in Rome?", tools=[WEATHER])
    (call,) = r1.output
    server.engine.script = server.script("Warm.")
    r2 = client.responses.create(model=server.settings.model_name, previous_response_id=r1.id, tools=[WEATHER],
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "28C"}])
    assert r2.output_text == "Warm."
    prompt = _prompt(server)
    assert "Weather in Rome?" in prompt and "Rome" in prompt.split("<｜Assistant｜>")[1]
    assert "<tool_result>28C</tool_result>" in prompt


def test_item_reference(server):
    client = server.openai()
    r1 = client.responses.create(model=server.settings.model_name, input="first")
    ref = {"type": "item_reference", "id": r1.output[0].id}
    client.responses.create(model=server.settings.model_name, input=[{"role": "user", "content": "q"}, ref,
                                                                     {"role": "user", "content": "next"}])
    assert DEFAULT_REPLY in _prompt(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.settings.model_name, input=[{"type": "item_reference", "id": "msg_x"}])
    assert e.value.body["param"] == "input[0].id"


def test_store_false_keeps_nothing(server):
    client = server.openai()
    r = client.responses.create(model=server.settings.model_name, input="secret", store=False)
    assert r.store is False and r.output_text == DEFAULT_REPLY
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.settings.model_name, input="x", previous_response_id=r.id)
    assert e.value.body == {"message": f"Previous response with id {r.id!r} not found.",
                            "type": "invalid_request_error", "param": "previous_response_id",
                            "code": "previous_response_not_found"}
    assert not os.path.exists(os.path.join(server.settings.kvstore.ssd_dir, "responses", r.id + ".json"))


def test_delete_then_get_404(server):
    client = server.openai()
    r = client.responses.create(model=server.settings.model_name, input="hi", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == DEFAULT_REPLY and got.metadata == {"k": "v"}
    path = os.path.join(server.settings.kvstore.ssd_dir, "responses", r.id + ".json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    with server.http() as http:
        d = http.delete(f"/v1/responses/{r.id}")
        assert d.status_code == 200 and d.json() == {"id": r.id, "object": "response", "deleted": True}
        assert http.get(f"/v1/responses/{r.id}").status_code == 404
        assert http.delete(f"/v1/responses/{r.id}").status_code == 404
        assert http.get("/v1/responses/..%2F..%2Fetc%2Fpasswd").status_code == 404
    assert not os.path.exists(path)


def test_client_disconnect_aborts_the_engine_request(server):
    server.engine.script = server.script(" tick" * 500)
    server.engine.step_delay_s = 0.01
    stream = server.openai().responses.create(model=server.settings.model_name, input="count", stream=True)
    for n, _ in enumerate(stream):
        if n == 5:
            break
    stream.close()  # closes the HTTP connection mid-stream
    assert server.engine.wait_for(lambda e: len(e.aborted) == 1 and e.num_active == 0, timeout=5)
    (call,) = server.engine.calls
    assert server.engine.aborted == [call.request_id] and call.request_id.startswith("resp_")
    with server.http() as http:  # never completed: not stored
        assert http.get(f"/v1/responses/{call.request_id}").status_code == 404
    with pytest.raises(openai.APITimeoutError):  # not streamed: the client gives up waiting
        server.openai(timeout=0.3).responses.create(model=server.settings.model_name, input="count")
    assert server.engine.wait_for(lambda e: len(e.aborted) == 2 and e.num_active == 0, timeout=5)


def test_unknown_tool_types_are_ignored(server, caplog):
    caplog.set_level(logging.INFO, logger="flashtier.server.responses.route")
    hosted = [{"type": "web_search"}, {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": []},
              {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "local_shell"},
              {"type": "mcp", "server_label": "x", "server_url": "http://x"},
              {"type": "custom", "name": "apply_patch"}, {"type": "image_generation"}]
    r = server.openai().responses.create(model=server.settings.model_name, input="hi", tools=[*hosted, WEATHER])
    assert r.output_text == DEFAULT_REPLY
    assert [t.type for t in r.tools] == ["function"] and r.tools[0].name == "get_weather"
    prompt = _prompt(server)
    assert "get_weather" in prompt and "web_search" not in prompt and "apply_patch" not in prompt
    notes = [rec.getMessage() for rec in caplog.records if "cannot run" in rec.getMessage()]
    assert len(notes) == 1 and "web_search" in notes[0] and "mcp" in notes[0]
    server.openai().responses.create(model=server.settings.model_name, input="hi", tools=hosted)
    assert "## Tools" not in _prompt(server)


def test_max_output_tokens_is_incomplete(server):
    client = server.openai()
    r = client.responses.create(model=server.settings.model_name, input="hi", max_output_tokens=3)
    assert server.engine.calls[-1].params.max_tokens == 3
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = _sse(server, {"input": "hi", "max_output_tokens": 3})
    _check_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_cached_tokens_and_prompt_cache_key_salt(server):
    client = server.openai()
    long = "You are a careful assistant. " * 30
    first = client.responses.create(model=server.settings.model_name, instructions=long, input="one")
    again = client.responses.create(model=server.settings.model_name, instructions=long, input="two")
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens >= 64
    keyed = client.responses.create(model=server.settings.model_name, instructions=long, input="two",
                                    prompt_cache_key="tenant-a")
    assert server.engine.calls[-1].cache_salt == "tenant-a" and keyed.prompt_cache_key == "tenant-a"
    assert keyed.usage.input_tokens_details.cached_tokens == 0


def test_prompt_cache_key_isolates_the_real_prefix_cache(tokenizer, tmp_path):
    """The real engine (tiny random weights, its real prefix cache): a key hits only its own entries."""
    from flashtier.engine.config import EngineConfig
    from flashtier.kvstore.config import KVStoreConfig

    from .engine_core_support import tiny_engine_core

    engine = tiny_engine_core(EngineConfig(max_num_batched_tokens=256), KVStoreConfig(block_size=16, num_blocks=400))
    with run_server(tokenizer, engine, kv_dir=str(tmp_path)) as server:
        client = server.openai()

        def cached(key):
            r = client.responses.create(model=server.settings.model_name, input="Go on.", max_output_tokens=1,
                                        instructions="Summarise the river valley settlements. " * 12,
                                        temperature=0, prompt_cache_key=key, store=False)
            assert r.usage.input_tokens >= 80  # five blocks of 16 and more
            return r.usage.input_tokens_details.cached_tokens

        assert cached("team-a") == 0
        assert cached("team-a") > 0  # the same key: its own entries
        assert cached("team-b") == 0  # another key: not team-a's
        assert cached(None) == 0


def test_errors_name_what_is_unsupported(server):
    client = server.openai()
    model = server.settings.model_name
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
    cases = [
        ({"input": [image]}, "input_image", "input[0].content[0]"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "computer_call_output",
         "input[0].type"),
        ({"input": "hi", "background": True}, "background", "background"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "web_search_preview", "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id", "input[0].call_id"),
        ({"input": "hi", "max_output_tokens": 10**6}, "maximum context length", "max_output_tokens"),
        ({"input": []}, "messages", "input"),
    ]
    for extra, words, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, **extra)
        assert words in e.value.body["message"] and e.value.body["param"] == param, (extra, e.value.body)
    assert server.engine.calls == []
