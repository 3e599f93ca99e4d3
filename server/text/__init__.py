"""Text: the DeepSeek V4 tokenizer with incremental detokenization, the chat template (``chat_encoding``),
DSML tool-call markup and its streaming parser, held-back suffixes, per-token texts for logprobs, the Engram
token map.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = [
    "chat_encoding", "choice_text", "dsml", "dsml_events", "dsml_markup", "engram_map", "token_texts", "tokenizer",
]
