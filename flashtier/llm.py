"""The offline API, vLLM style: ``LLM(model=DIR or preset=NAME).generate(prompts, params)``.

Text prompts are tokenized with the model's tokenizer (the DeepSeek V4 tokenizer unless the model
directory ships its own); token-id prompts pass through. Runs the synchronous engine to completion.

Like the server, this is the top of the stack: it uses the server's text side (tokenizer, Engram token
map) and the engine below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtier.engine.config import EngineConfig
from flashtier.engine.factory import build_engine
from flashtier.engine.core.outputs import TokenLogprob
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig
from flashtier.server.text.engram_map import install_token_map
from flashtier.server.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        preset: str = "tiny",
        seed: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 64,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
    ):
        self.tokenizer = Tokenizer.from_model_dir(model)
        config = EngineConfig(model_dir=model, preset=preset, weights_seed=seed, dtype=dtype, device=device,
                              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        kv = KVStoreConfig(block_size=block_size, num_blocks=num_blocks)
        self.engine = build_engine(config, kv)
        install_token_map(self.engine.model, self.tokenizer)
        self._counter = 0

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        """Complete every prompt (batched by the engine); results in input order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        order, texts, ids_of = [], {}, {}
        for p in prompts:
            rid = f"llm-{self._counter}"
            self._counter += 1
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            self.engine.add_request(rid, ids, params)
            order.append(rid)
            texts[rid] = p if isinstance(p, str) else None
            ids_of[rid] = ids
        tokens: dict[str, dict[int, list[int]]] = {rid: {} for rid in order}
        lps: dict[str, dict[int, list]] = {rid: {} for rid in order}
        reasons: dict[str, dict[int, str | None]] = {rid: {} for rid in order}
        cached: dict[str, int] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                cached[out.request_id] = out.cache.cached_tokens
                for c in out.choices:
                    tokens[out.request_id].setdefault(c.index, []).extend(c.token_ids)
                    if c.logprobs is not None:
                        lps[out.request_id].setdefault(c.index, []).extend(c.logprobs)
                    if c.finish_reason is not None:
                        reasons[out.request_id][c.index] = c.finish_reason
        results = []
        for rid in order:
            outs = [
                CompletionOutput(i, self.tokenizer.decode(tokens[rid].get(i, []), skip_special_tokens=True),
                                 tokens[rid].get(i, []), reasons[rid].get(i),
                                 lps[rid].get(i) if params.logprobs is not None else None)
                for i in range(params.n)
            ]
            results.append(GenerationResult(rid, texts[rid], ids_of[rid], outs, cached.get(rid, 0)))
        return results
