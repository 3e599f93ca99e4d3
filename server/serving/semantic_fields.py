"""Request fields that would change the answer if they were dropped: ``check_semantic_fields`` refuses them.

Requests ignore fields they do not know (protocol.py), which is right for fields that only label a request
or tune how it is served (``metadata``, ``store``, ``service_tier``, ``prediction``). It is wrong for a
field that changes what the answer means: a client asking for prompt logprobs, beam search or a banned
word list would get an answer silently without them, and could not tell. Such fields are declared in
protocol.py (typed ``Any``, so the message here is the one a client sees) and refused with a 400 naming
the field unless they hold their neutral value (null, false, empty).

Fields this server honours are not here: chat ``return_token_ids`` (openai/chat_route.py), completions
``echo`` and ``return_token_ids``, and the constrained-decoding fields (``guided_*``, ``structured_outputs``).
"""

from __future__ import annotations

from typing import Any

from flashtier.server.http.errors import BadRequest
from flashtier.server.protocol.request_models import ChatCompletionRequest, SamplingFields

__all__ = ["CHAT_ONLY", "REFUSED", "check_semantic_fields"]

# field -> why it cannot be honoured (the 400's message after "<field> is not supported: ")
REFUSED: dict[str, str] = {
    "prompt_logprobs": "the engine does not compute prompt logprobs",
    "use_beam_search": "beam search is not implemented; sample with n and a temperature instead",
    "truncate_prompt_tokens": "prompts are never truncated; shorten the prompt",
    "allowed_token_ids": "restricting the vocabulary is not implemented",
    "bad_words": "banning words is not implemented",
}
# chat-only fields (completions has its own, supported `echo`)
CHAT_ONLY: dict[str, str] = {
    "echo": "chat echo is not implemented",
    "continue_final_message": "continuing the final assistant message is not implemented",
    "chat_template": "the server renders the model's own V4.1 template; a custom template is not accepted",
}


def _neutral(value: Any) -> bool:
    """Null, false or empty: the value that asks for nothing."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def check_semantic_fields(body: SamplingFields) -> None:
    """``BadRequest`` (400, ``param`` = the field) for the first refused field that asks for something.
    Mutates nothing."""
    tables = (REFUSED, CHAT_ONLY) if isinstance(body, ChatCompletionRequest) else (REFUSED,)
    for table in tables:
        for name, reason in table.items():
            if not _neutral(getattr(body, name, None)):
                raise BadRequest(f"{name} is not supported: {reason}", param=name)
