"""Structured output on the server side: which grammar a request must match (``constraints``) and the
grammar compiler built from the tokenizer (``service``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["constraints", "service"]
