"""Seeded random weights for a model (tests, benchmarks and the demo checkpoint).

Scales are chosen so activations stay O(1) through 40 layers of mHC; every mixing, gating and
routing path gets non-trivial values so tests exercise it. ``snap_to_formats`` then rounds each
tensor to exactly what its checkpoint format can hold, so a written-and-loaded model is bit-equal.
"""

from __future__ import annotations

import math
import zlib

import torch

from flashtier.engine.model.transformer import Transformer, weight_formats


def _draw(name: str, shape: tuple[int, ...], normal) -> torch.Tensor:
    """One parameter's random value under the scale rules above; ``normal(shape, std, mean)`` draws."""
    if name.endswith("norm.weight"):
        return normal(shape, 0.1, 1.0)
    if name.endswith("attn_sink"):
        return normal(shape, 1.0)
    if "hc_" in name and name.endswith("_fn"):
        return normal(shape, 0.5 / math.sqrt(shape[1]))
    if "hc_" in name and name.endswith("_base"):
        return normal(shape, 0.5)
    if "hc_" in name and name.endswith("_scale"):
        return normal(shape, 0.2, 1.0)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return normal(shape, 0.1)
    if name.endswith(("q_weight", "k_weight")):
        return normal(shape, 0.2, 1.0)
    if name == "embed.weight" or name.endswith(("engram.embed.weight", "markov_head.embed.weight")):
        return normal(shape, 1.0)
    if len(shape) == 2:
        return normal(shape, 1.0 / math.sqrt(shape[1]))
    return normal(shape, 0.1)


@torch.no_grad()
def init_random_(model: Transformer, seed: int = 0) -> Transformer:
    """Fill every parameter from a generator seeded with ``seed``; mutates and returns ``model``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    for name, p in model.named_parameters():
        p.copy_(_draw(name, tuple(p.shape), normal).to(p.dtype))
    return model


@torch.no_grad()
def snap_to_formats(model: Transformer) -> Transformer:
    """Round every parameter to its checkpoint storage format in place (fp8 / mxfp4 / bf16 / fp32)."""
    from flashtier.engine.model.checkpoint import quantize_roundtrip

    params = dict(model.named_parameters())
    snapped = quantize_roundtrip({k: v.detach() for k, v in params.items()}, weight_formats(model))
    for name, value in snapped.items():
        params[name].copy_(value.to(params[name].dtype))
    return model


def random_model(cfg, *, seed: int = 0, dtype: torch.dtype = torch.float32, with_dspark: bool = True) -> Transformer:
    """A model with seeded random weights already snapped to the checkpoint formats.

    ``dtype=torch.float64`` gives the exactness-test mode: every parameter and all math in float64
    (see numerics.py).
    """
    model = Transformer(cfg, dtype=dtype, with_dspark=with_dspark)
    if dtype == torch.float64:
        model = model.double()
    init_random_(model, seed)
    return snap_to_formats(model).eval()


# An Engram table is drawn in chunks of this many rows, each from its own stream: a table of the real geometry
# (384M rows) is never whole as float anywhere, and a part of it can be drawn alone (rank_random.py)
TABLE_CHUNK_ROWS = 1 << 20


def parameter_seed(seed: int, name: str) -> int:
    """The seed of the stream parameter ``name`` (or one chunk of a table, ``name[row]``) is drawn from: every
    tensor its own, so a rank that draws only its part gets the values one process draws for the whole."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (1 << 63)


@torch.no_grad()
def draw_parameter(name: str, shape: tuple[int, ...], fmt: str, *, seed: int, device: torch.device | str,
                   rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Parameter ``name``'s value (fp32 on ``device``, already snapped to its checkpoint format ``fmt``) under
    ``random_model_on_device``'s rules; ``rows`` = (start, stop) draws only those rows of an Engram table
    (multiples of ``TABLE_CHUNK_ROWS``, or the table's end). ValueError for ``rows`` of another tensor or
    off the chunk grid."""
    from flashtier.engine.model.checkpoint import quantize_roundtrip
    from flashtier.engine.model.engram_offload import TABLE_SUFFIX

    def stream(key: str):
        gen = torch.Generator(device=device).manual_seed(parameter_seed(seed, key))
        return lambda sh, std, mean=0.0: torch.randn(sh, generator=gen, device=device) * std + mean

    if not name.endswith(TABLE_SUFFIX):
        if rows is not None:
            raise ValueError(f"draw_parameter: rows are drawn for Engram tables only, not {name}")
        return quantize_roundtrip({name: _draw(name, shape, stream(name))}, {name: fmt}, on_device=True)[name]
    start, stop = (0, shape[0]) if rows is None else rows
    if start % TABLE_CHUNK_ROWS or not (start <= stop <= shape[0]) or (stop % TABLE_CHUNK_ROWS and stop != shape[0]):
        raise ValueError(f"draw_parameter: rows {rows} of {name} {list(shape)} are off the {TABLE_CHUNK_ROWS}-row grid")
    out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32, device=device)
    for a in range(start, stop, TABLE_CHUNK_ROWS):  # fp8 rows: each row its own blocks, so chunks snap alone
        b = min(a + TABLE_CHUNK_ROWS, stop)
        # the scale rule of the whole table (its embedding std), whatever the chunk's shape
        chunk = _draw(name, (b - a, *shape[1:]), stream(f"{name}[{a}]"))
        out[a - start : b - start] = quantize_roundtrip({name: chunk}, {name: fmt}, on_device=True)[name]
    return out


def to_empty(model: Transformer, device: str | torch.device) -> Transformer:
    """``model.to_empty(device=device)``: every meta parameter and buffer as uninitialised storage on ``device``,
    same shapes, strides and dtypes. Allocated directly: ``nn.Module.to_empty`` runs ``empty_like`` on each meta
    tensor, whose meta decomposition imports sympy and the symbolic-shape machinery on first use (0.6-2.4 s per
    process on a 2-core VM, 0.04 s this way), paid by every engine process a server starts. Mutates ``model``
    (its tensors replaced) and returns it."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


@torch.no_grad()
def random_model_on_device(
    cfg, device: torch.device | str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, with_dspark: bool = True,
    host_engram: bool | None = None,
) -> Transformer:
    """``random_model`` built where it will run: parameters drawn and snapped to their formats on ``device``,
    one tensor at a time (seconds for flash-16e on a GPU, where the CPU path takes minutes).

    Same scale rules as ``random_model``, other generators: each parameter (and each chunk of an Engram
    table) is drawn from its own stream (``draw_parameter``), so the values do not depend on which other
    parameters exist or are drawn (a rank drawing only its share, rank_random.py, gets the same values). With
    ``host_engram`` (None = on for CUDA) each Engram table, drawn on the device like the rest (same values),
    then moves to host memory (engram_offload.py).
    """
    from flashtier.engine.model.engram import default_token_map
    from flashtier.engine.model.engram_offload import tables_to_host_, wants_host_tables

    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, with_dspark=with_dspark)
    model = to_empty(model, device)
    model.token_map = default_token_map(cfg).to(device)
    formats = weight_formats(model)
    for name, p in model.named_parameters():
        p.copy_(draw_parameter(name, tuple(p.shape), formats[name], seed=seed, device=device).to(p.dtype))
    if wants_host_tables(host_engram, device):
        tables_to_host_(model, device)
    return model.eval()
