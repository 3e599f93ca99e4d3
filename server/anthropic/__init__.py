"""Anthropic's Messages API (``/v1/messages``): its wire models, translation to a chat job, content
blocks, the event stream and the route (errors in Anthropic's shape are in ``server.http``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["route"]
