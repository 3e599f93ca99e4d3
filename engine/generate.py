"""Single-sequence generation over the incremental path (the ``flashtier generate`` command)."""

from __future__ import annotations

from pathlib import Path

import torch

from .model.config import preset
from .model.incremental import IncrementalModel
from .model.init import random_model
from .model.loader import load_model
from .model.transformer import Transformer


def load_for_cli(model_dir: str | Path | None, preset_name: str | None, seed: int = 0) -> Transformer:
    """A checkpoint directory's model, else the preset with seeded random weights."""
    if model_dir is not None:
        return load_model(model_dir, progress=False)
    return random_model(preset(preset_name or "tiny"), seed=seed, with_dspark=False)


def sample_token(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """Greedy at temperature 0, else Gumbel-max: argmax(softmax(l / T) / Exp(1))."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=gen)
    return int(torch.argmax(probs / noise))


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
    gen = torch.Generator(device=model.device).manual_seed(seed)
    logits = runner.prefill(state, prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = sample_token(logits, temperature, gen)
        if stop_ids and tok in stop_ids:
            break
        out.append(tok)
        if len(out) == max_tokens:
            break
        logits = runner.decode(state, tok)
    return out
