"""Transport: API errors and their JSON shapes (OpenAI's, Anthropic's), API-key auth, SSE, large JSON bodies
parsed off the event loop (``pooled_route``, ``frontend_pool``), client disconnects, request ids.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = [
    "anthropic_errors", "auth", "disconnect", "errors", "frontend_pool", "json_chunks", "pooled_route",
    "request_id", "sse",
]
