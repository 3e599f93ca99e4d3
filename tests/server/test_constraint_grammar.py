"""The grammars grammar/constraints.py builds, without a model: random logits under the grammar's mask
(so every allowed token is likely, far beyond what any model would write) over many seeds, and the
result read back by the same parser the API uses. Also: the model's own call format is accepted by
every tool grammar (forcing must not push the model off the markup it was trained on)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from flashtier.engine.grammar.compiler import GrammarCompiler
from flashtier.engine.grammar.mask import grammar_bitmask
from flashtier.engine.grammar.constraint import GrammarState
from flashtier.engine.sample.sampler import allowed_tokens
from flashtier.server.grammar.constraints import chat_constraint
from flashtier.server.text.dsml import DsmlStreamParser
from flashtier.server.text.dsml_events import CompletionBuilder
from flashtier.server.text.dsml_markup import CALLS_SEPARATOR, render_tool_calls
from flashtier.server.grammar.service import grammar_vocab
from flashtier.server.protocol.request_models import ChatCompletionRequest

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "unit": {"enum": ["c", "f"]}, "tags": {"type": "array", "maxItems": 2,
                                                                 "items": {"type": "boolean"}}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["utc"], "properties": {"utc": {"type": "boolean"}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ANSWER = {"type": "object", "required": ["kind"], "additionalProperties": False,
          "properties": {"kind": {"enum": ["cat", "dog"]}}}


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(grammar_vocab(tokenizer, tokenizer.vocab_size, (tokenizer.eos_id,)))


def _request(**fields) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": s, "strict": fields.pop("strict", None)}}
             for n, s in SCHEMAS.items()]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 **fields})


def _constraint(compiler, body):
    spec = chat_constraint(body, body.tools, body.tool_choice, body.parallel_tool_calls)
    return compiler.compile(spec)


def _sample(tokenizer, constraint, seed: int, max_tokens: int = 400) -> tuple[list[int], bool]:
    """Each next token uniformly among those the grammar allows; (tokens, ended with EOS)."""
    g = torch.Generator().manual_seed(seed)
    state, out = GrammarState(constraint), []
    for _ in range(max_tokens):
        allowed = allowed_tokens(grammar_bitmask([state], tokenizer.vocab_size), tokenizer.vocab_size)[0]
        ids = allowed.nonzero().flatten()
        tok = int(ids[torch.randint(len(ids), (1,), generator=g)])
        assert state.accept(tok)
        if tok == tokenizer.eos_id:
            return out, True
        out.append(tok)
    return out, False


def _parse(tokenizer, ids):
    parser, answer = DsmlStreamParser(False, True), CompletionBuilder()
    for ev in parser.feed(tokenizer.decode(ids)) + parser.finish():
        answer.add(ev)
    return answer.build()


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
])
def test_forced_calls_parse_and_validate_over_20_seeds(tokenizer, compiler, fields):
    constraint = _constraint(compiler, _request(**fields))
    ended = 0
    for seed in range(20):
        ids, done = _sample(tokenizer, constraint, seed)
        if not done:
            continue  # cut by max_tokens (an endless string value); the grammar still held for every token
        ended += 1
        answer = _parse(tokenizer, ids)
        assert answer.content == "" and answer.tool_calls, tokenizer.decode(ids)
        if fields.get("parallel_tool_calls") is False or "function" in str(fields["tool_choice"]):
            assert len(answer.tool_calls) == 1
        for call in answer.tool_calls:
            if isinstance(fields["tool_choice"], dict):
                assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert ended >= 15, f"only {ended} of 20 seeds finished within 400 tokens"


def test_strict_tools_leave_text_free_but_hold_any_call(tokenizer, compiler):
    constraint = _constraint(compiler, _request(strict=True))
    text = "It is sunny." + CALLS_SEPARATOR + render_tool_calls([("get_weather", {"city": "Paris", "days": 3, "unit": "c"})])
    bad = "It is sunny." + CALLS_SEPARATOR + render_tool_calls([("get_weather", {"city": "Paris", "days": 99, "unit": "c"})])
    assert _accepts(tokenizer, constraint, text) and not _accepts(tokenizer, constraint, bad)
    assert _accepts(tokenizer, constraint, "Just text, no call.")


def test_json_answer_or_a_call_when_tools_meet_response_format(tokenizer, compiler):
    body = _request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    constraint = _constraint(compiler, body)
    assert _accepts(tokenizer, constraint, '{"kind": "cat"}')
    assert _accepts(tokenizer, constraint, CALLS_SEPARATOR + render_tool_calls([("get_time", {"utc": True})]))
    assert not _accepts(tokenizer, constraint, '{"kind": "cow"}')
    assert not _accepts(tokenizer, constraint, "plain text")


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("name,args", [("get_weather", {"city": "Paris", "days": 3, "unit": "c", "tags": [True]}),
                                       ("get_time", {"utc": False})])
def test_the_models_own_call_format_is_accepted(tokenizer, compiler, compact, name, args):
    extra = {"structured_outputs": {"disable_any_whitespace": True}} if compact else {}
    for choice in ("required", {"type": "function", "function": {"name": name}}):
        constraint = _constraint(compiler, _request(tool_choice=choice, **extra))
        assert _accepts(tokenizer, constraint, CALLS_SEPARATOR + render_tool_calls([(name, args)]))
    wrong = {"type": "function", "function": {"name": "get_time" if name == "get_weather" else "get_weather"}}
    assert not _accepts(tokenizer, _constraint(compiler, _request(tool_choice=wrong)),
                        CALLS_SEPARATOR + render_tool_calls([(name, args)]))


def _accepts(tokenizer, constraint, text: str) -> bool:
    state = GrammarState(constraint)
    return all(state.accept(t) for t in tokenizer.encode(text, allow_special=True) + [tokenizer.eos_id]) \
        and state.matcher.is_terminated()
