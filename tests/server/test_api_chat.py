"""/v1/chat/completions through the openai SDK against a live server and a scripted engine."""

from __future__ import annotations

import json

import pytest

from flashtier.server.text.chat_encoding import REASONING_EFFORT_LINE
from flashtier.server.text.dsml_markup import render_tool_calls

from .conftest import DEFAULT_REPLY

USER = [{"role": "user", "content": "Say hello."}]

WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]


def _calls_text(*calls) -> str:
    return "\n\n" + render_tool_calls(calls)


def _assemble_stream(stream) -> dict:
    """Fold a chat stream into per-choice reasoning, content, tool calls and finish reasons."""
    out: dict = {"usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for ch in chunk.choices:
            c = out.setdefault(ch.index, {"content": "", "reasoning": "", "reasoning_alias": "", "calls": {},
                                          "finish": None, "roles": [], "logprobs": []})
            d = ch.delta
            if d.role:
                c["roles"].append(d.role)
            c["content"] += d.content or ""
            c["reasoning"] += getattr(d, "reasoning_content", None) or ""
            c["reasoning_alias"] += getattr(d, "reasoning", None) or ""
            for tc in d.tool_calls or []:
                call = c["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if ch.logprobs and ch.logprobs.content:
                c["logprobs"].extend(ch.logprobs.content)
            if ch.finish_reason:
                c["finish"] = ch.finish_reason
    return out


def test_non_streaming_reply(server):
    r = server.openai().chat.completions.create(model=server.settings.model_name, messages=USER)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == server.settings.model_name
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == DEFAULT_REPLY
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    u = r.usage
    assert u.completion_tokens == len(server.encode(DEFAULT_REPLY))
    (call,) = server.engine.calls
    assert u.prompt_tokens == len(call.prompt_token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.completion_tokens_details.reasoning_tokens == 0
    assert u.model_extra["flashtier"] == {"cached_tokens_by_tier": {"hbm": 0, "ssd": 0, "snapshot": 0},
                                          "decoder_tokens": 0, "approximate_replay_tokens": 0,
                                          "computed_tokens": u.prompt_tokens, "persisted_bytes": 0,
                                          "resume": {"kind": "cold", "replay_from": None, "approximate": False}}


def test_prompt_is_the_v41_encoding(server):
    from flashtier.server.text.chat_encoding import encode_to_ids

    messages = [{"role": "system", "content": "Be brief."}, *USER]
    server.openai().chat.completions.create(model=server.settings.model_name, messages=messages)
    assert list(server.engine.calls[0].prompt_token_ids) == encode_to_ids(server.tokenizer, messages)


def test_model_may_be_omitted_and_content_parts_are_joined(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == server.settings.model_name
    prompt = server.tokenizer.decode(server.engine.calls[0].prompt_token_ids)
    assert "a\n\nb" in prompt


def test_streaming_reply_and_include_usage(server):
    stream = server.openai().chat.completions.create(
        model=server.settings.model_name, messages=USER, stream=True, stream_options={"include_usage": True})
    out = _assemble_stream(stream)
    assert out[0]["roles"] == ["assistant"]
    assert out[0]["content"] == DEFAULT_REPLY
    assert out[0]["finish"] == "stop"
    assert out["usage"].completion_tokens == len(server.encode(DEFAULT_REPLY))
    assert out["usage"].prompt_tokens_details.cached_tokens == 0
    assert out["usage"].completion_tokens_details.reasoning_tokens == 0


def test_streaming_without_include_usage_has_no_usage(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == DEFAULT_REPLY


def test_n_2_streaming_and_not(server):
    server.engine.script = [server.script("first reply"), server.script("second, longer reply")]
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == ["first reply", "second, longer reply"]
    assert r.usage.completion_tokens == len(server.encode("first reply")) + len(server.encode("second, longer reply"))
    out = _assemble_stream(client.chat.completions.create(
        model=server.settings.model_name, messages=USER, n=2, stream=True, stream_options={"include_usage": True}))
    assert out[0]["content"] == "first reply" and out[1]["content"] == "second, longer reply"
    assert out[0]["finish"] == out[1]["finish"] == "stop"
    assert out["usage"].completion_tokens == r.usage.completion_tokens


def test_sampling_parameters_reach_the_engine(server):
    server.openai().chat.completions.create(
        model=server.settings.model_name, messages=USER, seed=1234, temperature=0.7, top_p=0.9, max_tokens=50,
        presence_penalty=0.5, frequency_penalty=-0.5, user="u1",
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "stop_token_ids": [7], "cache_salt": "tenant-a", "ignore_eos": False})
    (call,) = server.engine.calls
    p = call.params
    assert (p.seed, p.temperature, p.top_p, p.max_tokens) == (1234, 0.7, 0.9, 50)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (40, 0.05, 1.1, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.stop_token_ids) == (0.5, -0.5, (7,))
    assert p.logprobs is None and p.n == 1
    assert call.cache_salt == "tenant-a"


def test_default_max_tokens_fills_the_context_and_max_completion_tokens_wins(server):
    client = server.openai()
    client.chat.completions.create(model=server.settings.model_name, messages=USER)
    call = server.engine.calls[-1]
    assert call.params.max_tokens == server.engine.max_model_len - len(call.prompt_token_ids)
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, max_tokens=100,
                                       max_completion_tokens=3)
    assert server.engine.calls[-1].params.max_tokens == 3
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_string_truncates_and_aborts(server):
    server.engine.script = server.script("alpha beta STOP gamma delta epsilon")
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, stop=["STOP", "zeta"])
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == "STOP"
    assert server.engine.wait_for(lambda e: len(e.aborted) == 1)
    out = _assemble_stream(client.chat.completions.create(model=server.settings.model_name, messages=USER,
                                                          stop="STOP", stream=True))
    assert out[0]["content"] == "alpha beta " and out[0]["finish"] == "stop"
    assert server.engine.wait_for(lambda e: len(e.aborted) == 2)
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, stop="STOP",
                                       extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "alpha beta STOP"


def test_stop_string_split_across_tokens_is_never_emitted(server):
    # one token per step: "ST" and "OP" arrive in different deltas
    text = "one two STOP three"
    server.engine.script = server.script(text)
    out = _assemble_stream(server.openai().chat.completions.create(
        model=server.settings.model_name, messages=USER, stop="TOP", stream=True))
    assert out[0]["content"] == "one two S"


def test_logprobs_shape(server):
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = server.encode(DEFAULT_REPLY)
    assert len(content) == len(ids)
    assert "".join(e.token for e in content) == DEFAULT_REPLY
    for e, tok in zip(content, ids):
        assert isinstance(e.logprob, float) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode("utf-8") == server.tokenizer.decode([tok])
    assert server.engine.calls[0].params.logprobs == 3
    out = _assemble_stream(client.chat.completions.create(model=server.settings.model_name, messages=USER,
                                                          logprobs=True, stream=True))
    assert [e.token for e in out[0]["logprobs"]] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in out[0]["logprobs"])
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER)
    assert r.choices[0].logprobs is None


def test_logprob_bytes_of_a_multibyte_character(server):
    server.engine.script = server.script("naïve 日本")
    r = server.openai().chat.completions.create(model=server.settings.model_name, messages=USER, logprobs=True)
    content = r.choices[0].logprobs.content
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == "naïve 日本"
    assert r.choices[0].message.content == "naïve 日本"


def test_thinking_reasoning_content(server):
    server.engine.script = server.script("Let me think. 2+2=4.</think>The answer is 4.")
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, reasoning_effort="high")
    msg = r.choices[0].message
    assert msg.content == "The answer is 4."
    assert msg.model_extra["reasoning_content"] == "Let me think. 2+2=4."
    assert msg.model_extra["reasoning"] == "Let me think. 2+2=4."
    assert r.usage.completion_tokens_details.reasoning_tokens == len(server.encode("Let me think. 2+2=4."))
    prompt = server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)
    assert REASONING_EFFORT_LINE.format(n=75) in prompt and prompt.endswith("<think>")
    out = _assemble_stream(client.chat.completions.create(
        model=server.settings.model_name, messages=USER, stream=True, reasoning_effort="max",
        stream_options={"include_usage": True}))
    assert out[0]["reasoning"] == out[0]["reasoning_alias"] == "Let me think. 2+2=4."
    assert out[0]["content"] == "The answer is 4."
    assert out["usage"].completion_tokens_details.reasoning_tokens == r.usage.completion_tokens_details.reasoning_tokens
    assert REASONING_EFFORT_LINE.format(n=100) in server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)


@pytest.mark.parametrize("effort,level", [("low", 50), ("minimal", 50), ("medium", 75), ("xhigh", 100)])
def test_reasoning_effort_levels(server, effort, level):
    server.openai().chat.completions.create(model=server.settings.model_name, messages=USER,
                                            reasoning_effort=effort)
    assert REASONING_EFFORT_LINE.format(n=level) in server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)


def test_thinking_switch_via_chat_template_kwargs(server):
    client = server.openai()
    client.chat.completions.create(model=server.settings.model_name, messages=USER,
                                   extra_body={"chat_template_kwargs": {"thinking": True}})
    assert server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids).endswith("<｜Assistant｜><think>")
    client.chat.completions.create(model=server.settings.model_name, messages=USER, reasoning_effort="high",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids).endswith("<｜Assistant｜></think>")
    client.chat.completions.create(model=server.settings.model_name, messages=USER, reasoning_effort="none")
    assert server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids).endswith("</think>")


def test_reasoning_sent_back_is_rendered_and_hits_the_cache(server):
    server.engine.script = server.script("I should greet.</think>Hello!")
    client = server.openai()
    first_turn = [{"role": "system", "content": "You are a helpful assistant. " * 20}, *USER]
    first = client.chat.completions.create(model=server.settings.model_name, messages=first_turn,
                                           reasoning_effort="high")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    msg = first.choices[0].message
    history = [*first_turn, {"role": "assistant", "content": msg.content,
                       "reasoning_content": msg.model_extra["reasoning_content"]},
               {"role": "user", "content": "And again, with much more text so that the prompt grows. " * 8}]
    second = client.chat.completions.create(model=server.settings.model_name, messages=history,
                                            reasoning_effort="high")
    p1, p2 = (c.prompt_token_ids for c in server.engine.calls)
    generated = server.encode("I should greet.</think>Hello!")
    assert p2[: len(p1) + len(generated) + 1] == (*p1, *generated, server.tokenizer.eos_id)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (len(p1) + len(generated)) // 64 * 64 and cached > 0
    assert second.usage.model_extra["flashtier"]["cached_tokens_by_tier"]["hbm"] == cached
    # the alias `reasoning` renders the same prompt
    history[2] = {"role": "assistant", "content": msg.content, "reasoning": msg.model_extra["reasoning"]}
    client.chat.completions.create(model=server.settings.model_name, messages=history, reasoning_effort="high")
    assert server.engine.calls[-1].prompt_token_ids == p2


def test_tool_calls_streamed_assemble_to_the_non_streaming_calls(server):
    text = ("Checking two things." + _calls_text(("get_weather", {"city": "Paris", "days": 3}),
                                                 ("get_time", {"tz": "Europe/Paris"})))
    server.engine.script = server.script(text)
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking two things."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Europe/Paris"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    out = _assemble_stream(client.chat.completions.create(model=server.settings.model_name, messages=USER,
                                                          tools=WEATHER_TOOLS, stream=True))
    assert out[0]["finish"] == "tool_calls"
    assert out[0]["content"] == "Checking two things."
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out[0]["calls"].items())]
    assert streamed == calls
    assert all(c["id"].startswith("call_") for c in out[0]["calls"].values())


def test_tool_call_with_thinking_and_history_round_trip(server):
    text = "Need the weather.</think>" + _calls_text(("get_weather", {"city": "Oslo"}))
    server.engine.script = server.script(text)
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS,
                                       tool_choice="auto", reasoning_effort="low")
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == "Need the weather."
    (call,) = msg.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # the agent sends the turn back with the tool result; the prompt continues the first one exactly
    history = [*USER, {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                       "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    server.engine.script = server.script("Got it.</think>It is sunny.")
    r2 = client.chat.completions.create(model=server.settings.model_name, messages=history, tools=WEATHER_TOOLS,
                                        reasoning_effort="low")
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    p1, p2 = (c.prompt_token_ids for c in server.engine.calls)
    generated = tuple(server.encode(text) + [server.tokenizer.eos_id])
    assert p2[: len(p1) + len(generated)] == tuple(p1) + generated


def test_parallel_tool_calls_false_keeps_the_first(server):
    server.engine.script = server.script(_calls_text(("get_weather", {"city": "A"}), ("get_time", {"tz": "B"})))
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS,
                                       parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    out = _assemble_stream(client.chat.completions.create(model=server.settings.model_name, messages=USER,
                                                          tools=WEATHER_TOOLS, parallel_tool_calls=False,
                                                          stream=True))
    assert [c["name"] for c in out[0]["calls"].values()] == ["get_weather"]


def test_tool_choice_none_and_named(server):
    text = _calls_text(("get_weather", {"city": "A"}))
    server.engine.script = server.script(text)
    client = server.openai()
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS,
                                       tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text
    # the tools block is in the prompt either way (the prefix does not depend on tool_choice)
    assert "## Tools" in server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    r = client.chat.completions.create(model=server.settings.model_name, messages=USER, tools=WEATHER_TOOLS,
                                       tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"


def test_malformed_dsml_becomes_content(server):
    text = "Intro\n\n<｜DSML｜ calls>\n<｜DSML｜ bogus>"
    server.engine.script = server.script(text)
    r = server.openai().chat.completions.create(model=server.settings.model_name, messages=USER,
                                                tools=WEATHER_TOOLS)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"


def test_length_inside_a_tool_call_is_length_without_markup(server):
    # every cut point, on every API, is in test_api_tool_call_cut.py
    text = _calls_text(("get_weather", {"city": "A long city name"}))
    server.engine.script = server.script(text)
    r = server.openai().chat.completions.create(model=server.settings.model_name, messages=USER,
                                                tools=WEATHER_TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content == ""  # the name is not complete


def test_developer_and_tool_messages_are_accepted(server):
    messages = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "noon"}]}]
    r = server.openai().chat.completions.create(model=server.settings.model_name, messages=messages,
                                                tools=WEATHER_TOOLS)
    assert r.choices[0].message.content == DEFAULT_REPLY
    assert "<tool_result>noon</tool_result>" in server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)
