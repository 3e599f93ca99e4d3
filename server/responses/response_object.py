"""The Responses API's ``response`` object: what it echoes of the request, its status and its usage.

``ResponseEnvelope`` is fixed when the request is accepted (id, creation time, model, the echoed request
fields); ``render`` adds what the generation decided::

    finish "stop"/"tool_calls" -> status completed
    finish "length"            -> status incomplete, incomplete_details {reason: max_output_tokens}
    finish "abort" or an error -> status failed, error {code: server_error, message}

usage maps chat's: prompt_tokens -> input_tokens (+ input_tokens_details.cached_tokens), completion_tokens
-> output_tokens (+ output_tokens_details.reasoning_tokens), plus the ``flashtier`` tier breakdown. The
pydantic models at the end only document the shape in the OpenAPI document.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from flashtier.server.responses.protocol import ResponsesRequest
from flashtier.server.responses.translate import ResponsesTranslation

__all__ = ["DeletedResponse", "ResponseEnvelope", "ResponseObject", "response_status", "responses_usage"]


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage dict (state.usage_dict) in the Responses shape."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": chat_usage["completion_tokens_details"]["reasoning_tokens"]},
        "total_tokens": chat_usage["total_tokens"],
        "flashtier": chat_usage["flashtier"],
    }


def response_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) for a choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    return "failed", None


@dataclass(frozen=True)
class ResponseEnvelope:
    """A response's identity and the request fields it echoes. Immutable."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]

    @classmethod
    def of(cls, response_id: str, model: str, body: ResponsesRequest, tr: ResponsesTranslation,
           store: bool) -> ResponseEnvelope:
        reasoning = body.reasoning
        fmt = body.text.format if body.text is not None else None
        text: dict[str, Any] = {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else
                                {"type": "text"}}
        if body.text is not None and body.text.verbosity is not None:
            text["verbosity"] = body.text.verbosity
        echo = {
            "instructions": body.instructions,
            "tools": tr.tools,
            "tool_choice": tr.tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
            "store": store,
            "text": text,
            "truncation": body.truncation or "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "service_tier": body.service_tier or "default",
            "prompt_cache_key": body.prompt_cache_key,
            "background": False,
        }
        return cls(response_id, int(time.time()), model, echo)

    def render(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, *,
               incomplete_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object with this status, output and usage (None while in progress)."""
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "model": self.model, "output": output, "usage": usage if done else None, **self.echo,
        }


class ResponseObject(BaseModel):
    """A ``response`` (documentation of the shape; items and usage as described in docs/api.md)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["response"]
    deleted: bool
