"""Request checks that pydantic's per-field ranges cannot express, shared by chat, completions and
/tokenize: text that cannot be UTF-8, ``n`` against --max-n, fields whose meaning cannot be honoured
(semantic_fields.py), prompt + max_tokens against the context, and max_tokens when a request sets none
(--max-tokens-default). Each raises ``BadRequest`` (HTTP 400) naming the offending field.
"""

from __future__ import annotations

from typing import Any

from flashtier.server.http.errors import BadRequest
from flashtier.server.protocol.request_models import SamplingFields
from flashtier.server.serving.semantic_fields import check_semantic_fields
from flashtier.server.config.settings import ServerSettings

__all__ = ["check_common", "check_text", "resolve_max_tokens"]

_CHECK_SLICE = 1 << 19  # characters encoded per step by check_text


def check_text(value: Any, where: str) -> None:
    """Reject strings that cannot be UTF-8 (lone surrogates from JSON escapes such as \\ud800)."""
    if isinstance(value, str):
        try:
            # in slices: one encode of a 20 MB prompt holds the GIL ~50 ms (the loop waits), a slice ~2 ms
            for start in range(0, len(value), _CHECK_SLICE):
                value[start:start + _CHECK_SLICE].encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{where} contains invalid Unicode (a lone surrogate)", param=where) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)
            check_text(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]")


def check_common(settings: ServerSettings, body: SamplingFields) -> None:
    """Checks shared by chat and completions that pydantic's per-field ranges cannot express."""
    if body.n > settings.max_n:
        raise BadRequest(f"n must be at most {settings.max_n} on this server, got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options can only be set when stream is true", param="stream_options")
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported", param="logit_bias")
    check_semantic_fields(body)
    for name in ("stop", "cache_salt", "user"):
        check_text(getattr(body, name), name)


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, *, prompt_param: str,
                       tokens_param: str, default: int = 0) -> int:
    """max_tokens for the engine: the request's, else `default` (--max-tokens-default) capped by what is
    left of the context (0: all of it, vLLM's behaviour); 400 on overflow."""
    if prompt_len == 0:
        raise BadRequest("the prompt is empty", param=prompt_param)
    if prompt_len >= max_model_len or (requested is not None and prompt_len + requested > max_model_len):
        asked = f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion)" \
            if requested is not None else f"{prompt_len} tokens in the prompt, leaving no room for a completion"
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked}. "
            "Please reduce the length of the prompt or of the completion.",
            param=tokens_param if requested is not None else prompt_param, code="context_length_exceeded")
    if requested is not None:
        return requested
    left = max_model_len - prompt_len
    return min(default, left) if default > 0 else left
