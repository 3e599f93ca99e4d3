"""A tool call cut off by max_tokens, at every cut point, through the official SDKs on all three APIs.

The scripted engine writes one call's exact DSML tokens; the request's max_tokens (1 .. the whole
sequence) cuts it after each of them. Whatever the cut, no markup reaches the client; once the call's
name is complete the answer has the call with the arguments written so far:

- chat: ``finish_reason: "length"``, the call in ``tool_calls`` (arguments possibly incomplete JSON),
  ``content`` null;
- Responses: ``status: "incomplete"`` (``max_output_tokens``), the ``function_call`` item with those
  arguments (item status ``incomplete`` until the invoke closed);
- Messages: ``stop_reason: "max_tokens"``, a ``tool_use`` block, ``input: {}`` while the arguments are
  incomplete (streamed: the ``input_json_delta`` fragments sent, which concatenate to those arguments).

Before the name is complete there is no call and no text. Forced calls (the grammar writes the markup
from the first token) and calls after some text with ``tool_choice`` auto take the same path.
The expected arguments come from milestones in the decoded text, not from the server's parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from flashtier.server.text.dsml_markup import render_tool_calls

ARGS = {"city": "Paris", "days": 3}
FULL_ARGS = json.dumps(ARGS)  # '{"city": "Paris", "days": 3}', the arguments of the complete call
CALL_TEXT = "\n\n" + render_tool_calls([("get_weather", ARGS)])
LEAD = "Let me check."  # the text before the call with tool_choice auto
USER = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS, "strict": False}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": PARAMS}]
# (what the decoded output contains once the milestone is reached, the arguments from then on)
MILESTONES = [
    ('invoke name="get_weather"', "{"),
    ('name="city" string="true">', '{"city": "'),
    ('string="true">Paris', '{"city": "Paris'),
    ("Paris</｜DSML｜ parameter>", '{"city": "Paris"'),
    ('name="days" string="false">', '{"city": "Paris", "days": '),
    ('string="false">3', '{"city": "Paris", "days": 3'),
    ("</｜DSML｜ invoke>", FULL_ARGS),
]
MARKUP = ("｜DSML｜", "<｜", "DSML", "\n\n<")


def _expected(server, lead: str, k: int) -> tuple[str, str | None]:
    """(the text, the call's arguments or None) of an output cut after its first `k` tokens."""
    text = server.tokenizer.decode(server.encode(lead + CALL_TEXT)[:k])
    args = None
    for marker, value in MILESTONES:
        if marker in text:
            args = value
    return text[: len(lead)], args


def _no_markup(*texts: str | None) -> None:
    for text in texts:
        assert not any(m in (text or "") for m in MARKUP), repr(text)


def _cut_points(server, lead: str) -> range:
    n = len(server.encode(lead + CALL_TEXT))
    assert n > 40  # the call's markup is long enough to have every milestone
    return range(1, n + 1)


MODES = {"forced": "", "auto": LEAD}


def _each_cut(server, lead: str, check: Callable[[int], None]) -> None:
    """`check(k)` for every cut point, a few requests at a time (the server takes them concurrently)."""
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(check, _cut_points(server, lead)))


def test_the_milestones_cover_every_stage_of_the_call(server):
    seen = [_expected(server, "", k)[1] for k in _cut_points(server, "")]
    assert seen[0] is None and seen[-1] == FULL_ARGS
    assert [a for i, a in enumerate(seen) if a is not None and a != seen[i - 1]] == [v for _, v in MILESTONES]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_chat_cut_at_every_token(server, mode, stream):
    lead = MODES[mode]
    server.engine.script = server.script(lead + CALL_TEXT)
    client = server.openai()
    tool_choice = "required" if mode == "forced" else "auto"

    def check(k: int) -> None:
        want_text, want_args = _expected(server, lead, k)
        fields = dict(model=server.settings.model_name, messages=USER, tools=CHAT_TOOLS, tool_choice=tool_choice,
                      max_tokens=k)
        if stream:
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(**fields, stream=True):
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    for tc in ch.delta.tool_calls or []:
                        call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                        call["name"] = call["name"] or (tc.function.name if tc.function else None)
                        call["arguments"] += (tc.function.arguments if tc.function else None) or ""
                    finish = ch.finish_reason or finish
            got_calls = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            choice = client.chat.completions.create(**fields).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            got_calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            if want_args is not None:
                assert content is None if not want_text else content == want_text, k
        _no_markup(content, *(a for _, a in got_calls))
        assert finish == "length", k
        assert (content or "") == want_text, k
        assert got_calls == ([] if want_args is None else [("get_weather", want_args)]), k

    _each_cut(server, lead, check)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_responses_cut_at_every_token(server, mode, stream):
    lead = MODES[mode]
    server.engine.script = server.script(lead + CALL_TEXT)
    client = server.openai()
    tool_choice = {"type": "function", "name": "get_weather"} if mode == "forced" else "auto"

    def check(k: int) -> None:
        want_text, want_args = _expected(server, lead, k)
        fields = dict(model=server.settings.model_name, input="Weather in Paris for 3 days?", tools=RESPONSES_TOOLS,
                      tool_choice=tool_choice, max_output_tokens=k, store=False)
        if stream:
            events = list(client.responses.create(**fields, stream=True))
            assert events[-1].type == "response.incomplete", k
            r = events[-1].response
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
            assert done == ([] if want_args is None else [want_args]) and deltas == (want_args or ""), k
            text_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert text_deltas == want_text, k
        else:
            r = client.responses.create(**fields)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", k
        messages = [item for item in r.output if item.type == "message"]
        texts = [part.text for item in messages for part in item.content]
        calls = [item for item in r.output if item.type == "function_call"]
        _no_markup(*texts, *(c.arguments for c in calls))
        assert texts == ([want_text] if want_text else []), k
        if want_args is None:
            assert calls == [], k
        else:
            (call,) = calls
            assert (call.name, call.arguments) == ("get_weather", want_args), k
            assert call.status == ("completed" if want_args == FULL_ARGS else "incomplete"), k
            assert call.call_id.startswith("call_"), k

    _each_cut(server, lead, check)


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_messages_cut_at_every_token(server, mode, stream):
    lead = MODES[mode]
    server.engine.script = server.script(lead + CALL_TEXT)
    client = _anthropic(server)
    tool_choice = {"type": "tool", "name": "get_weather"} if mode == "forced" else {"type": "auto"}

    def check(k: int) -> None:
        want_text, want_args = _expected(server, lead, k)
        fields = dict(model=server.settings.model_name, messages=USER, tools=MESSAGES_TOOLS, tool_choice=tool_choice,
                      max_tokens=k)
        if stream:
            with client.messages.stream(**fields) as s:
                events = list(s)
                message = s.get_final_message()
            partial = "".join(e.partial_json for e in events if e.type == "input_json")
            assert partial == (want_args or ""), k
            assert [e.type for e in events].count("content_block_stop") == len(message.content), k
        else:
            message = client.messages.create(**fields)
        assert message.stop_reason == "max_tokens" and message.stop_sequence is None, k
        texts = [b.text for b in message.content if b.type == "text"]
        uses = [b for b in message.content if b.type == "tool_use"]
        _no_markup(*texts, *(json.dumps(u.input) for u in uses))
        assert texts == ([want_text] if want_text else []), k
        assert [b.type for b in message.content] == ["text"] * bool(want_text) + ["tool_use"] * (want_args is not None)
        if want_args is not None:
            (use,) = uses
            assert use.name == "get_weather" and use.id.startswith("toolu_"), k
            if want_args == FULL_ARGS:
                assert use.input == ARGS, k
            elif not stream:
                assert use.input == {}, k  # the arguments are not a whole JSON object yet

    _each_cut(server, lead, check)
