"""Which grammar a request's output must match: request fields -> ``ConstraintSpec`` (or None).

    tool_choice "required" / named (chat, Responses; Messages `any` / `tool`)   -> a forced DSML calls block
    tools with `strict: true` and tool_choice "auto"                             -> free text, and any calls
                                                                                    block the model opens holds
    response_format json_schema / json_object                                    -> that JSON
    structured_outputs {json | regex | choice | grammar | json_object}, guided_*  -> that grammar

Tool calls are the V4.1 DSML markup (dsml_markup.py); the grammar for it is xgrammar's "deepseek_v4_1"
structural tag, whose parameters are written as the model writes them (raw text for strings, JSON for
the rest). A JSON answer format combined with tools (an agent with an output type) allows either the
JSON answer or a calls block. Two sources that cannot both hold (a forced call and a JSON answer, or
two grammars) are a 400 naming both fields.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from flashtier.engine.grammar.compiler import MAX_WHITESPACE
from flashtier.engine.grammar.constraint import ConstraintKind, ConstraintSpec
from flashtier.server.http.errors import BadRequest
from flashtier.server.protocol.request_models import NamedToolChoice, SamplingFields, Tool

if TYPE_CHECKING:  # imported where used: engine/grammar/compiler.py says why
    from xgrammar.structural_tag import StructuralTag

__all__ = ["chat_constraint", "completion_constraint"]

MODEL_FORMAT = "deepseek_v4_1"
CALL_WHITESPACE = 4  # most whitespace characters in a row inside a calls block


def completion_constraint(body: SamplingFields) -> ConstraintSpec | None:
    """The grammar of `response_format` / `structured_outputs` / `guided_*`; 400 when several are set."""
    specs = _format_specs(body)
    if len(specs) > 1:
        raise BadRequest(f"only one output constraint may be set; got {' and '.join(s.label for s in specs)}",
                         param=specs[1].label.split(".")[0])
    if not specs:
        return None
    compact = body.structured_outputs is not None and body.structured_outputs.disable_any_whitespace
    return dataclasses.replace(specs[0], any_whitespace=not compact)


def chat_constraint(body: SamplingFields, tools: list[Tool] | None, tool_choice: Any,
                    parallel_tool_calls: bool) -> ConstraintSpec | None:
    """The grammar of a chat request: tool forcing and strict tools combined with its answer format."""
    answer = completion_constraint(body)
    # The model writes its calls with one newline between tags and json.dumps spacing in values: a few
    # whitespace characters in a row are all it needs (test_constraint_grammar checks its own format
    # passes); compact output allows one.
    compact = body.structured_outputs is not None and body.structured_outputs.disable_any_whitespace
    ws = 1 if compact else CALL_WHITESPACE
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not tools or choice == "none":
        return answer
    forced = isinstance(choice, NamedToolChoice) or choice == "required"
    if forced and answer is not None:
        raise BadRequest(f"tool_choice {_choice_text(choice)} forces a tool call, which cannot also match "
                         f"{answer.label}", param="tool_choice")
    if forced:
        chosen = [t for t in tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
        tag = _calls_tag(chosen, "forced" if isinstance(choice, NamedToolChoice) else "required", parallel_tool_calls,
                        ws)
        return ConstraintSpec(ConstraintKind.STRUCTURAL_TAG, tag.model_dump_json(), "tool_choice")
    if answer is not None:
        if answer.kind not in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
            raise BadRequest(f"{answer.label} cannot be combined with tools (only a JSON answer format can)",
                             param=answer.label.split(".")[0])
        calls = _calls_tag(tools, "required", parallel_tool_calls, ws)
        schema: dict[str, Any] | bool = json.loads(answer.source) if answer.kind is ConstraintKind.JSON_SCHEMA else True
        from xgrammar.structural_tag import JSONSchemaFormat, OrFormat, StructuralTag

        answer_format = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=1 if compact else MAX_WHITESPACE)
        either = StructuralTag(format=OrFormat(elements=[answer_format, calls.format]))
        return ConstraintSpec(ConstraintKind.STRUCTURAL_TAG, either.model_dump_json(), answer.label)
    if any(t.function.strict for t in tools):
        tag = _calls_tag(tools, "auto", parallel_tool_calls, ws)
        return ConstraintSpec(ConstraintKind.STRUCTURAL_TAG, tag.model_dump_json(), "tools.strict")
    return None


def _calls_tag(tools: list[Tool], mode: str, parallel: bool, whitespace: int) -> StructuralTag:
    params = [{"type": "function", "function": {"name": t.function.name,
                                                "parameters": t.function.parameters or {"type": "object"}}}
              for t in tools]
    import xgrammar as xgr

    try:
        return xgr.get_model_structural_tag(MODEL_FORMAT, tools=params, tool_choice=_xgr_choice(mode, tools),
                                            reasoning="disabled", parallel_tool_calls=parallel,
                                            max_whitespace_cnt=whitespace)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"tools: cannot build the tool-call grammar: {exc}", param="tools") from None


def _xgr_choice(mode: str, tools: list[Tool]) -> Any:
    if mode == "forced":
        return {"type": "function", "function": {"name": tools[0].function.name}}
    return mode


def _choice_text(choice: Any) -> str:
    return f"{{function: {choice.function.name!r}}}" if isinstance(choice, NamedToolChoice) else repr(choice)


def _format_specs(body: SamplingFields) -> list[ConstraintSpec]:
    specs: list[ConstraintSpec] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(ConstraintSpec(ConstraintKind.JSON_OBJECT, "", "response_format.json_object"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequest("response_format.json_schema.schema is required for type json_schema",
                             param="response_format")
        specs.append(_json_spec(fmt.json_schema.schema_, "response_format.json_schema"))
    elif fmt is not None and fmt.type == "structural_tag":
        raise BadRequest("response_format structural_tag is not supported; use structured_outputs or tools",
                         param="response_format")
    so = body.structured_outputs
    legacy = {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice,
              "grammar": body.guided_grammar}
    fields = {"json": so.json_ if so else None, "regex": so.regex if so else None,
              "choice": so.choice if so else None, "grammar": so.grammar if so else None}
    for name, value in fields.items():
        if value is not None:
            specs.append(_field_spec(name, value, f"structured_outputs.{name}"))
    if so is not None and so.json_object:
        specs.append(ConstraintSpec(ConstraintKind.JSON_OBJECT, "", "structured_outputs.json_object"))
    if so is not None and so.structural_tag is not None:
        specs.append(ConstraintSpec(ConstraintKind.STRUCTURAL_TAG, so.structural_tag, "structured_outputs.structural_tag"))
    for name, value in legacy.items():
        if value is not None:
            specs.append(_field_spec(name, value, f"guided_{name}"))
    return specs


def _field_spec(name: str, value: Any, label: str) -> ConstraintSpec:
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise BadRequest(f"{label} must be a JSON schema (an object, or a string holding one)",
                                 param=label.split(".")[0]) from None
        return _json_spec(value, label)
    if name == "choice":
        if not value:
            raise BadRequest(f"{label} must list at least one string", param=label.split(".")[0])
        return ConstraintSpec(ConstraintKind.CHOICE, json.dumps(value, ensure_ascii=False), label)
    kind = ConstraintKind.REGEX if name == "regex" else ConstraintKind.GRAMMAR
    return ConstraintSpec(kind, value, label)


def _json_spec(schema: Any, label: str) -> ConstraintSpec:
    if not isinstance(schema, (dict, bool)):
        raise BadRequest(f"{label}: the schema must be a JSON object", param=label.split(".")[0])
    return ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), label)
