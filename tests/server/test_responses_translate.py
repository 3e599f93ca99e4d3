"""responses_translate on its own: Responses items and fields -> the chat request prepare_chat_job runs."""

from __future__ import annotations

import pytest

from flashtier.server.http.errors import BadRequest
from flashtier.server.responses.protocol import ResponsesRequest, encode_reasoning
from flashtier.server.responses.translate import parse_input, translate

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _chat(**body):
    req = ResponsesRequest.model_validate({"input": "hi", **body})
    return translate(req, parse_input(req)).chat


def _messages(items, **body):
    return [m.model_dump(exclude_none=True) for m in _chat(input=items, **body).messages]


def test_an_assistant_turn_is_one_message():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "A"}'}
    items = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call, {**call, "call_id": "call_2", "arguments": '{"city": "B"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "not rendered"}],
         "encrypted_content": encode_reasoning("again")},
        {"role": "assistant", "content": "Done."},
        {"role": "assistant", "content": "More."},
    ]
    user, first, out1, out2, second, third = _messages(items, tools=[WEATHER])
    assert user == {"role": "user", "content": "q"}
    assert first["role"] == "assistant" and first["reasoning_content"] == "think"
    assert first["content"] == [{"type": "text", "text": "Checking."}]
    calls = [(c["id"], c["function"]["arguments"]) for c in first["tool_calls"]]
    assert calls == [("call_1", '{"city": "A"}'), ("call_2", '{"city": "B"}')]
    assert out1 == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert out2["content"] == [{"type": "text", "text": "rain"}]
    assert (second["reasoning_content"], second["content"]) == ("again", "Done.")  # a summary is not reasoning
    assert (third["reasoning_content"], third["content"]) == ("", "More.")
    foreign = [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-from-elsewhere"},
               {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert _messages(foreign)[0]["reasoning_content"] == ""


def test_unsupported_parts_and_items_are_named():
    cases = [({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input_file"),
             ({"role": "user", "content": [{"type": "mystery"}]}, "mystery"),
             ({"type": "local_shell_call", "id": "x"}, "local_shell_call"),
             ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}, "input_image"),
             ({"role": "tool", "content": "x"}, "role")]
    for item, words in cases:
        with pytest.raises(BadRequest) as e:
            _chat(input=[item])
        assert words in e.value.message and e.value.param.startswith("input[0]"), e.value.message
    with pytest.raises(BadRequest, match="a tool needs a string `type`"):
        _chat(tools=[{"name": "x"}])
    with pytest.raises(BadRequest) as e:
        _chat(text={"format": {"type": "json_schema", "schema": {}}})
    assert e.value.param == "text.format.name"


def test_translation_of_tool_choice_and_text_format():
    c = _chat(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    assert c.tool_choice.function.name == "get_weather" and c.parallel_tool_calls is False
    assert c.tools[0].function.name == "get_weather" and c.tools[0].function.parameters == WEATHER["parameters"]
    assert _chat(tools=[WEATHER], tool_choice="required").tool_choice == "required"
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    c = _chat(tools=[WEATHER, {**WEATHER, "name": "other"}], tool_choice=allowed)
    assert c.tool_choice == "required" and [t.function.name for t in c.tools] == ["get_weather"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = _chat(text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
             max_output_tokens=9, reasoning={"effort": "low"}, prompt_cache_key="k", temperature=0.5, top_p=0.5)
    fmt = c.response_format.model_dump(by_alias=True, exclude_none=True)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "out"
    assert fmt["json_schema"]["schema"] == schema and fmt["json_schema"]["strict"] is True
    fields = (c.max_completion_tokens, c.reasoning_effort, c.cache_salt, c.temperature, c.top_p)
    assert fields == (9, "low", "k", 0.5, 0.5)
    assert _chat(text={"format": {"type": "json_object"}}).response_format.type == "json_object"
    assert _chat(text={"format": {"type": "text"}}).response_format is None
