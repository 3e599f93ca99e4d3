"""Where a model's Engram tables live: parameters on the model's device, or host memory (``engram_host.py``).

    tables_to_host_(model, device)                     a float model's tables -> host (placement, random init)
    attach_host_tables_(model, tables, device, dtype)  tables read in their stored form (device_loader)
    prefetch_engram(model, layers, ids, tokens)        a part's gathers issued before its first layer runs

The setting: ``host_engram=None``, the placement functions' default, means "on for a CUDA device" (the real
tables, 2 x ~98 GB, must not sit in HBM); True / False force it either way (True on the CPU: tests).
"""

from __future__ import annotations

import torch

from flashtier.engine.model.engram import Engram
from flashtier.engine.model.engram_host import HostEngramTables
from flashtier.engine.model.engram_table import HostTable
from flashtier.engine.model.transformer import Transformer

TABLE_SUFFIX = "engram.embed.weight"


def wants_host_tables(host_engram: bool | None, device: torch.device | str) -> bool:
    """The ``host_engram`` setting resolved for ``device``: None = on for CUDA, off elsewhere."""
    return torch.device(device).type == "cuda" if host_engram is None else bool(host_engram)


def _engrams(model: Transformer) -> list[Engram]:
    return [b.engram for b in model.layers if b.engram is not None]


def attach_host_tables_(model: Transformer, tables: dict[int, HostTable], device: torch.device | str,
                        dtype: torch.dtype) -> HostEngramTables:
    """Mutates ``model``: every Engram layer drops its ``embed`` parameter and reads ``tables`` (one shared
    ``HostEngramTables`` bringing rows to ``device`` as ``dtype``). Raises ValueError unless ``tables`` holds
    exactly the model's Engram layers."""
    engrams = {e.layer: e for e in _engrams(model)}
    if set(tables) != set(engrams):
        raise ValueError(f"tables: has Engram layers {sorted(tables)}, the model has {sorted(engrams)}")
    host = HostEngramTables(tables, n_hashes=model.cfg.engram_n_hashes, device=device, dtype=dtype)
    for layer, engram in engrams.items():
        engram.embed = None
        engram.host = host
    return host


@torch.no_grad()
def tables_to_host_(model: Transformer, device: torch.device | str) -> HostEngramTables | None:
    """Move every Engram table the model holds as a parameter into host memory (pinned when ``device`` is CUDA),
    as fp8 rows when that is exact (``HostTable.from_weight``); rows are then brought to ``device``.

    Mutates ``model`` (see ``attach_host_tables_``); device memory the tables held is handed back to the driver
    so the KV pool can be sized over it. Returns the host tables (the existing ones when already moved; None
    for a model without Engram layers)."""
    engrams = _engrams(model)
    if not engrams or engrams[0].embed is None:
        return engrams[0].host if engrams else None
    weights = {e.layer: e.embed.weight.detach() for e in engrams}
    dtype = next(iter(weights.values())).dtype
    pin = torch.device(device).type == "cuda"
    tables = {layer: HostTable.from_weight(w, pin=pin) for layer, w in weights.items()}
    on_cuda = any(w.is_cuda for w in weights.values())
    del weights
    host = attach_host_tables_(model, tables, device, dtype)
    if on_cuda:
        torch.cuda.empty_cache()
    return host


def prefetch_engram(model: Transformer, layers: range, ngram_ids: torch.Tensor, tokens: torch.Tensor | None) -> None:
    """Issue, before the first of ``layers`` runs, the host gather and copy of every Engram layer among them
    that reads host tables. ``ngram_ids``: the classes those layers will be called with (the key they find
    their rows by); ``tokens [T, n]``: the same rows' token ids on the host (-1 before position 0). A no-op
    without host tables or host tokens (the layers then gather on demand)."""
    engrams = [model.layers[i].engram for i in layers if model.layers[i].engram is not None]
    engrams = [e for e in engrams if e.host is not None]
    if not engrams or tokens is None:
        return
    host = engrams[0].host
    classes = host.host_classes(model.token_map, model.cfg.engram_pad_token_id, tokens)
    host.prefetch(ngram_ids, {e.layer: e.rows(classes) for e in engrams})
