"""OpenAI's chat completions and completions: the routes, the chat job (prompt rendering, grammar, engine
request) that the Responses and Messages APIs reuse, and the per-choice output builders.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["chat_choice", "chat_job", "chat_prompt", "chat_route", "completions_route"]
