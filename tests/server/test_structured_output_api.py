"""Constrained decoding through the HTTP APIs on the real engine (tiny demo model, random weights):
its unconstrained output is noise, so a schema-valid answer or a parseable, schema-valid tool call
can only come from the grammar. Checked with jsonschema on the parsed output."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from flashtier.engine.async_engine import AsyncEngine
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.model.init import random_model
from flashtier.kvstore.config import KVStoreConfig

from .conftest import run_server

MODEL = "flashtier-tiny"
NO_THINKING = {"thinking": False}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"enum": ["c", "f"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["utc"], "properties": {"utc": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def real(tokenizer):
    engine = Engine(random_model(preset("tiny"), seed=0, with_dspark=False),
                    EngineConfig(max_num_batched_tokens=512, max_num_seqs=64), KVStoreConfig(block_size=16, num_blocks=800))
    client = AsyncEngine(engine).start()
    with run_server(tokenizer, client, max_n=32) as server:
        yield server


def test_json_schema_answers_validate_over_20_seeds(real):
    out = real.openai(timeout=600).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], n=20, seed=11, temperature=1.0,
        max_tokens=400, extra_body={"chat_template_kwargs": NO_THINKING},
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": ANSWER, "strict": True}})
    assert len(out.choices) == 20
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    assert len({c.message.content for c in out.choices}) > 1  # 20 seeds, not one answer


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_on_chat_yields_a_schema_valid_call(real, tool_choice):
    out = real.openai(timeout=600).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, n=4, seed=5, temperature=1.0, max_tokens=400,
        extra_body={"chat_template_kwargs": NO_THINKING})
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0].function
        if isinstance(tool_choice, dict):
            assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_tool_choice_on_messages_yields_a_schema_valid_call(real, tool_choice):
    client = anthropic.Anthropic(base_url=real.url, api_key=real.api_key, max_retries=0, timeout=600)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for seed in range(3):
        msg = client.messages.create(model=MODEL, max_tokens=400, tools=tools, tool_choice=tool_choice,
                                     thinking={"type": "disabled"}, temperature=1.0,
                                     messages=[{"role": "user", "content": f"What time is it? ({seed})"}])
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) >= 1, msg
        for use in uses:
            if tool_choice["type"] == "tool":
                assert use.name == "get_time"
            jsonschema.validate(use.input, SCHEMAS[use.name])


def test_structured_outputs_regex_and_choice_on_completions(real):
    client = real.openai(timeout=600)
    regex = client.completions.create(model=MODEL, prompt="Code:", n=4, seed=2, temperature=1.0, max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": r"[A-F]{2}-\d{3}"}})
    import re
    assert all(re.fullmatch(r"[A-F]{2}-\d{3}", c.text) for c in regex.choices), [c.text for c in regex.choices]
    choice = client.completions.create(model=MODEL, prompt="Pick:", n=4, seed=3, temperature=1.0, max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.text in ("yes", "no", "maybe") for c in choice.choices)
