"""Single-sequence generation over the incremental path (the ``flashtier generate`` command)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.incremental import IncrementalModel
from flashtier.engine.model.init import random_model
from flashtier.engine.model.loader import load_model
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.sample.sampler import Sampler, SamplerRow, generator_for
from flashtier.engine.sample.params import SamplingParams


def load_for_cli(model_dir: str | Path | None, preset_name: str | None, seed: int = 0) -> Transformer:
    """A checkpoint directory's model, else the preset with seeded random weights."""
    if model_dir is not None:
        return load_model(model_dir, progress=False)
    return random_model(preset(preset_name or "tiny"), seed=seed, with_dspark=False)


@torch.no_grad()
def generate_text_ids(
    model: Transformer,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: set[int] | None = None,
) -> list[int]:
    """Prefill ``prompt`` (CED with decoder bounded replay), then sample up to ``max_tokens`` tokens."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    runner = IncrementalModel(model)
    state = runner.new_state()
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    gen = generator_for(params, model.device)
    sampler = Sampler()
    logits = runner.prefill(state, prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = int(sampler(logits[None], [SamplerRow(params, out, prompt, gen)]).token_ids[0])
        if stop_ids and tok in stop_ids:
            break
        out.append(tok)
        if len(out) == max_tokens:
            break
        logits = runner.decode(state, tok)
    return out
