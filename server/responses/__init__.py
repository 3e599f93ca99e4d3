"""OpenAI's Responses API (``/v1/responses``): its wire models, input translation to a chat job, output
items, the event stream and the route.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["route"]
