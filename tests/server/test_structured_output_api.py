"""Constrained decoding through the HTTP APIs on the real engine (tiny demo model, random weights):
its unconstrained output is noise, so a schema-valid answer or a parseable, schema-valid tool call
can only come from the grammar. Checked with jsonschema on the parsed output. One case per API and
mode here (the CPU model takes ~0.3 s a step); every tool_choice mode over many seeds, and the model's
own call format, are checked without a model in test_constraint_grammar.py."""

from __future__ import annotations

import concurrent.futures
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import pytest

from flashtier.engine.config import EngineConfig
from flashtier.kvstore.config import KVStoreConfig

from .conftest import run_server
from .engine_core_support import tiny_engine_core

MODEL = "flashtier-tiny"
pytestmark = pytest.mark.slow  # the CPU model runs every grammar token (all requests at once: ``answers``)
NO_THINKING = {"thinking": False}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"enum": ["c", "f"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["utc"], "properties": {"utc": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
UNIT = {"type": "object", "required": ["unit"], "properties": {"unit": {"enum": ["c", "f"]}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK, "get_unit": UNIT}


@pytest.fixture(scope="module")
def real(tokenizer):
    client = tiny_engine_core(EngineConfig(max_num_batched_tokens=512, max_num_seqs=64),
                              KVStoreConfig(block_size=16, num_blocks=800))
    with run_server(tokenizer, client, max_n=32) as server:
        yield server


def _json_schema(real):
    return real.openai(timeout=600).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], n=20, seed=11, temperature=1.0,
        max_tokens=200, extra_body={"chat_template_kwargs": NO_THINKING, "structured_outputs": {"disable_any_whitespace": True}},
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": ANSWER, "strict": True}})


def _json_object(real):
    return real.openai(timeout=600).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please."}], n=2, seed=1, temperature=1.0,
        max_tokens=300, extra_body={"chat_template_kwargs": NO_THINKING,
                                    "structured_outputs": {"json": {"type": "object", "required": ["a"], "additionalProperties": False, "properties": {"a": {"type": "boolean"}}}}})


def _chat_tool(real, tool_choice):
    return real.openai(timeout=600).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, n=1, seed=5, temperature=1.0, max_tokens=300,
        extra_body={"chat_template_kwargs": NO_THINKING, "structured_outputs": {"disable_any_whitespace": True}})


def _messages_tool(real, tool_choice):
    client = anthropic.Anthropic(base_url=real.url, api_key=real.api_key, max_retries=0, timeout=600)
    tools = [{"name": "get_unit", "input_schema": UNIT}, {"name": "get_time", "input_schema": CLOCK}]
    return [client.messages.create(model=MODEL, max_tokens=300, tools=tools,
                                   tool_choice={**tool_choice, "disable_parallel_tool_use": True},
                                   thinking={"type": "disabled"},
                                   messages=[{"role": "user", "content": f"What time is it? ({seed})"}])
            for seed in range(1)]


def _responses_tool(real, tool_choice):
    tools = [{"type": "function", "name": "get_unit", "parameters": UNIT},
             {"type": "function", "name": "get_time", "parameters": CLOCK}]
    return real.openai(timeout=600).responses.create(
        model=MODEL, input="What time is it?", tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
        reasoning={"effort": "none"}, max_output_tokens=300, store=False)


def _regex_and_choice(real):
    client = real.openai(timeout=600)
    regex = client.completions.create(model=MODEL, prompt="Code:", n=4, seed=2, temperature=1.0, max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": r"[A-F]{2}-\d{3}"}})
    choice = client.completions.create(model=MODEL, prompt="Pick:", n=4, seed=3, temperature=1.0, max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    return regex, choice


CHAT_TOOL_CHOICES = [{"type": "function", "function": {"name": "get_time"}}]
MESSAGES_TOOL_CHOICES = [{"type": "any"}]
RESPONSES_TOOL_CHOICES = [{"type": "function", "name": "get_time"}]


@pytest.fixture(scope="module")
def answers(real):
    """Every request of the module, sent at once: the engine decodes them in the same steps, so the module costs
    about its longest request instead of the sum of all of them (each step is mostly per-layer overhead on the
    CPU, whatever its batch). Each test checks its own answer (``.result()`` re-raises a failed request)."""
    calls = {"json_schema": (_json_schema,), "json_object": (_json_object,), "regex_and_choice": (_regex_and_choice,)}
    calls |= {("chat", json.dumps(c)): (_chat_tool, c) for c in CHAT_TOOL_CHOICES}
    calls |= {("messages", json.dumps(c)): (_messages_tool, c) for c in MESSAGES_TOOL_CHOICES}
    calls |= {("responses", json.dumps(c)): (_responses_tool, c) for c in RESPONSES_TOOL_CHOICES}
    with ThreadPoolExecutor(len(calls), thread_name_prefix="structured") as pool:
        futures = {key: pool.submit(fn, real, *args) for key, (fn, *args) in calls.items()}
        concurrent.futures.wait(futures.values())
    return futures


def test_json_schema_answers_validate_over_20_seeds(answers):
    out = answers["json_schema"].result()
    assert len(out.choices) == 20
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    assert len({c.message.content for c in out.choices}) > 1  # 20 seeds, not one answer
    assert all(" " not in c.message.content.replace("\\u0020", "") or '"' in c.message.content for c in out.choices)


def test_json_object_with_free_whitespace(answers):
    out = answers["json_object"].result()
    for c in out.choices:
        assert c.finish_reason == "stop" and json.loads(c.message.content).keys() == {"a"}, c.message.content


@pytest.mark.parametrize("tool_choice", CHAT_TOOL_CHOICES)
def test_forced_tool_choice_on_chat_yields_a_schema_valid_call(answers, tool_choice):
    out = answers[("chat", json.dumps(tool_choice))].result()
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0].function
        if isinstance(tool_choice, dict):
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("tool_choice", MESSAGES_TOOL_CHOICES)
def test_forced_tool_choice_on_messages_yields_a_schema_valid_call(answers, tool_choice):
    for msg in answers[("messages", json.dumps(tool_choice))].result():
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) >= 1, msg
        for use in uses:
            if tool_choice["type"] == "tool":
                assert use.name == "get_time"
            jsonschema.validate(use.input, SCHEMAS[use.name])


@pytest.mark.parametrize("tool_choice", RESPONSES_TOOL_CHOICES)
def test_forced_tool_choice_on_responses_yields_a_schema_valid_call(answers, tool_choice):
    out = answers[("responses", json.dumps(tool_choice))].result()
    calls = [item for item in out.output if item.type == "function_call"]
    assert out.status == "completed" and len(calls) == 1, out.output
    if isinstance(tool_choice, dict):
        assert calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_structured_outputs_regex_and_choice_on_completions(answers):
    import re

    regex, choice = answers["regex_and_choice"].result()
    assert all(re.fullmatch(r"[A-F]{2}-\d{3}", c.text) for c in regex.choices), [c.text for c in regex.choices]
    assert all(c.text in ("yes", "no", "maybe") for c in choice.choices)
