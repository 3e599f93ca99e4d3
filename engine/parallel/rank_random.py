"""A rank's share of the demo's random weights, drawn on its device one tensor at a time, in stored formats.

    model = random_rank_model(cfg, groups, device, seed=..., dtype=...)   collective over the world group

The one-process demo draws the whole model and then shards it (``random_model_on_device`` +
``shard_model_``): at the real V4.1-Flash geometry that is 1.4 TiB of float weights on each GPU, and each rank
pinning its own copy of the two Engram tables (2 x 132 GiB with torch's rounding). Here each rank plans the
model on "meta", shards it, and draws only its parameters: ``draw_parameter`` gives each tensor (and each
chunk of an Engram table) its own seeded stream, so a rank's share equals the same share of the one-process
model, bit for bit. Each whole tensor is drawn and snapped on the device, then cut (a TP slice is cut after
the snapping, as the checkpoint's blocks are); an expert-parallel block converts its experts to MXFP4 as
soon as its last tensor is drawn (``BlockConversion``, as a checkpoint load does); the rest goes through
``place_in_formats_``. The transient: one tensor in float32 + one block's float experts.

The Engram tables (host memory, ``host_engram``) are drawn once per host, not once per rank: global rank 0
creates a file per table (``TableFile``: /dev/shm when it has the room, so the bytes are memory the host
shares), the ranks fill its 1M-row chunks side by side (chunk i by rank i mod world), every rank maps it
read-only as it maps a checkpoint's table, and the file's name is removed once all have mapped it (the pages
live as long as a mapping). ``sparse_tables`` leaves the files
unwritten: zero rows, no memory until touched (the one-GPU emulation of the real geometry).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from flashtier.engine.model.device_loader import BlockConversion, place_in_formats_, set_parameter
from flashtier.engine.model.engram import default_token_map
from flashtier.engine.model.engram_offload import TABLE_SUFFIX, attach_host_tables_, wants_host_tables
from flashtier.engine.model.engram_table import HostTable, TableFile
from flashtier.engine.model.init import TABLE_CHUNK_ROWS, draw_parameter
from flashtier.engine.model.transformer import Transformer, weight_formats
from flashtier.engine.parallel.process_group import ParallelGroups
from flashtier.engine.parallel.shard_model import rank_slices, shard_model_

__all__ = ["random_rank_model"]

SHARED_MEMORY_DIR = Path("/dev/shm")


@torch.no_grad()
def random_rank_model(
    cfg, groups: ParallelGroups, device: torch.device | str, *, seed: int, dtype: torch.dtype,
    host_engram: bool | None = None, table_dir: Path | None = None, sparse_tables: bool = False,
) -> Transformer:
    """This rank's part of ``random_model_on_device(cfg, device, seed=seed, dtype=dtype, with_dspark=False)``,
    sharded by ``groups`` and placed in its stored formats (module docstring). ``host_engram`` (None = on for
    CUDA): the tables as one shared mapping per host, written under ``table_dir`` (default: /dev/shm when it
    has the room, else the temporary directory). Collective over the world group when it holds several
    ranks (every rank calls it). ValueError (from ``shard_model_``) when the split does not fit the model;
    OSError when no directory has room for the tables."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(cfg, dtype=dtype, with_dspark=False)
    whole = {name: tuple(p.shape) for name, p in model.named_parameters()}
    formats = weight_formats(model)
    model = shard_model_(model, groups)
    slices = rank_slices(model)
    names = [name for name, _ in model.named_parameters()]
    tables = [n for n in names if n.endswith(TABLE_SUFFIX)] if wants_host_tables(host_engram, device) else []
    blocks = BlockConversion(model, names, device)
    for name in names:
        if name in tables:
            continue
        value = draw_parameter(name, whole[name], formats[name], seed=seed, device=device)
        cut = slices.get(name)
        if cut is not None:
            value = value.narrow(cut.axis, cut.start, cut.size)
        set_parameter(model, name, value.to(model.get_parameter(name).dtype).contiguous())
        del value
        blocks.tensor_set(name)
    model.token_map = default_token_map(cfg).to(device)
    if tables:
        mapped = _shared_tables(model, {n: whole[n] for n in tables}, formats, device, seed, table_dir, sparse_tables)
        attach_host_tables_(model, mapped, device, dtype)
    return place_in_formats_(model, device, host_engram=False)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _table_dir(table_dir: Path | None, nbytes: int) -> Path:
    """Where the table files go: ``table_dir``, else /dev/shm when it has ``nbytes`` free (a container's is
    often 64 MB), else the temporary directory. OSError when the chosen one has not the room."""
    candidates = [table_dir] if table_dir is not None else [SHARED_MEMORY_DIR, Path(tempfile.gettempdir())]
    for directory in candidates:
        if directory.is_dir() and os.access(directory, os.W_OK):
            st = os.statvfs(directory)
            if st.f_bavail * st.f_frsize >= nbytes:
                return directory
    raise OSError(f"no room for {nbytes / 2**30:.1f} GiB of Engram tables in {[str(c) for c in candidates]}")


def _shared_tables(model: Transformer, shapes: dict[str, tuple[int, int]], formats: dict[str, str],
                   device: torch.device, seed: int, table_dir: Path | None, sparse: bool) -> dict[int, HostTable]:
    """The tables ``shapes`` (name -> whole shape) in one file each, created by global rank 0, filled by every
    rank (chunk i by rank i mod world, so the GPUs draw side by side) and mapped read-only by every rank:
    collective over the world group (a broadcast of the directory, three barriers)."""
    rank, world = _world()
    nbytes = 0 if sparse else sum(TableFile.size(shape) for shape in shapes.values())
    where = [str(tempfile.mkdtemp(prefix="flashtier-engram-", dir=_table_dir(table_dir, nbytes)))] if rank == 0 \
        else [None]
    if world > 1:
        dist.broadcast_object_list(where, src=0)
    directory = Path(where[0])
    files = {name: TableFile(directory / f"{name}.bin", shape) for name, shape in shapes.items()}
    try:
        if rank == 0:
            for table in files.values():
                table.create()
        if world > 1:
            dist.barrier()
        if not sparse:
            for name, table in files.items():
                codes, scales = table.writable()
                for start in range(rank * TABLE_CHUNK_ROWS, table.shape[0], world * TABLE_CHUNK_ROWS):
                    rows = (start, min(start + TABLE_CHUNK_ROWS, table.shape[0]))
                    table.fill(codes, scales, start, draw_parameter(name, table.shape, formats[name], seed=seed,
                                                                    device=device, rows=rows))
                del codes, scales
        if world > 1:
            dist.barrier()
        # registering faults every page in: not for sparse files, whose point is that untouched rows take none
        register = device.type == "cuda" and not sparse
        mapped = {model.get_submodule(name.removesuffix(".embed.weight")).layer: table.map(register=register)
                  for name, table in files.items()}
        if world > 1:
            dist.barrier()
    finally:
        if rank == 0:  # the mappings keep the pages; only the names go
            shutil.rmtree(directory, ignore_errors=True)
    return mapped
