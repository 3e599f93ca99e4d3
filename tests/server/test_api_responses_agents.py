"""The OpenAI Agents SDK against a live server: an agent with one function tool, through the Responses
model (``OpenAIResponsesModel``, the SDK's default) and the chat model (``OpenAIChatCompletionsModel``),
and an agent with an ``output_type`` (json_schema through text.format). The scripted engine writes a DSML
call first and, once the prompt holds the tool's result, the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from pydantic import BaseModel

from flashtier.server.text.dsml_markup import render_tool_calls

from .conftest import LiveServer, restore_defaults, run_server


@pytest.fixture(scope="module")
def module_server(tokenizer, tmp_path_factory) -> Iterator[LiveServer]:
    with run_server(tokenizer, kv_dir=str(tmp_path_factory.mktemp("kv"))) as server:
        yield server


@pytest.fixture
def server(module_server) -> Iterator[LiveServer]:
    restore_defaults(module_server.engine, module_server.tokenizer)
    yield module_server
    restore_defaults(module_server.engine, module_server.tokenizer)


def _call(name: str, **arguments) -> str:
    return "\n\n" + render_tool_calls([(name, arguments)])


def _prompt(server: LiveServer) -> str:
    return server.tokenizer.decode(server.engine.calls[-1].prompt_token_ids)



def _agent_script(server: LiveServer):
    """A DSML call to add(2, 3) first; once the prompt holds its result, a text answer."""
    call = server.script(_call("add", a=2, b=3))
    answer = server.script("The sum is 5.")

    def script(prompt, params):
        return answer if "<tool_result>5</tool_result>" in server.tokenizer.decode(prompt) else call
    return script


def _run_agent(server: LiveServer, model_cls, **agent_kwargs):
    set_tracing_disabled(True)
    seen = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def main():
        client = server.async_openai()
        model = model_cls(model=server.settings.model_name, openai_client=client)
        agent = Agent(name="adder", instructions="Use the tool.", tools=[add], model=model, **agent_kwargs)
        return await Runner.run(agent, "What is 2 + 3?")

    return asyncio.run(main()), seen


def test_agents_sdk_responses_model(server):
    server.engine.script = _agent_script(server)
    result, seen = _run_agent(server, OpenAIResponsesModel)
    assert seen == [(2, 3)] and result.final_output == "The sum is 5."
    assert len(server.engine.calls) == 2 and "Use the tool." in _prompt(server)


def test_agents_sdk_chat_completions_model(server):
    server.engine.script = _agent_script(server)
    result, seen = _run_agent(server, OpenAIChatCompletionsModel)
    assert seen == [(2, 3)] and result.final_output == "The sum is 5."
    assert len(server.engine.calls) == 2


@pytest.mark.parametrize("model_cls", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_agents_sdk_output_type(server, model_cls):
    class Sum(BaseModel):
        total: int

    def script(prompt, params):
        if "<tool_result>5</tool_result>" in server.tokenizer.decode(prompt):
            return server.script('{"total": 5}')
        return server.script(_call("add", a=2, b=3))

    server.engine.script = script
    result, seen = _run_agent(server, model_cls, output_type=Sum)
    assert seen == [(2, 3)] and result.final_output == Sum(total=5)
    # both turns ran under the grammar "the Sum schema or a call of add" (tools + a JSON answer format)
    labels = [c.params.constraint.label for c in server.engine.calls if c.params.constraint is not None]
    assert len(labels) == 2 and all(label.endswith("json_schema") for label in labels), labels
