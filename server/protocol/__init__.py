"""The OpenAI wire models every API builds on: chat and completions requests (``request_models``) and
responses, chunks, models, tokenize and errors (``response_models``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["request_models", "response_models"]
