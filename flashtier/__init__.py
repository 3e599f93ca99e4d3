"""flashtier: an OpenAI-compatible serving daemon for DeepSeek-V4.1-Flash with tiered KV storage.

The import package maps the repository's root folders: ``flashtier.server`` is ``server/``,
``flashtier.engine`` is ``engine/``, ``flashtier.kvstore`` is ``kvstore/`` and
``flashtier.kernels`` is ``kernels/`` (see pyproject.toml). The offline API::

    from flashtier import LLM, SamplingParams
    LLM(preset="tiny").generate(["Hello"], SamplingParams(max_tokens=8))
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # lazy: importing flashtier.kernels must not load the model stack
    if name == "LLM":
        from flashtier.llm import LLM

        return LLM
    if name == "SamplingParams":
        from flashtier.engine.sample.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
