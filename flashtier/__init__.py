"""flashtier: an OpenAI-compatible serving daemon for DeepSeek-V4.1-Flash with tiered KV storage.

The import package maps the repository's root folders: ``flashtier.server`` is ``server/``,
``flashtier.engine`` is ``engine/``, ``flashtier.kvstore`` is ``kvstore/`` and
``flashtier.kernels`` is ``kernels/`` (see pyproject.toml).
"""

__version__ = "0.1.0"
