"""Keep every step's logits of an engine (the tests compare two engines step by step)."""

import torch


def record_logits(engine, into: list | None = None, *, to_host: bool = False) -> list[torch.Tensor | None]:
    """Wrap ``engine.runner.execute``: ``into`` (a new list by default, returned) gains each step's logits (None
    without decoder work), a copy (float64 on the host when ``to_host``)."""
    seen = [] if into is None else into
    execute = engine.runner.execute

    def wrapped(batch):
        out = execute(batch)
        if out.logits is None:
            seen.append(None)
        else:
            seen.append(out.logits.double().cpu() if to_host else out.logits.clone())
        return out

    engine.runner.execute = wrapped
    return seen
