"""A model on the GPU with its weights as the checkpoint stores them: no float copy of what is quantised.

    load_model_in_formats(dir, "cuda")     checkpoint shards streamed to the device tensor by tensor
    load_parts_(meta_model, dir, ...)     the same for a sharded model: only its slices' bytes are read
    place_in_formats_(model, "cuda")       a float model (random weights made on the device) converted

FP8 linears become ``Fp8Linear`` (e4m3 codes + e8m0 32x32 scales), each MoE's routed experts (MXFP4) and shared
expert (FP8) one ``ExpertWeights``; everything else (bf16 / fp32 tensors) is dequantised into the parameter's
dtype. The Engram tables stay in host memory in their stored form (``host_engram``, default on for CUDA;
engram_offload.py): a loaded table is a shared read-only mapping of its checkpoint bytes, one copy per host
whatever the number of ranks (engram_table.py); otherwise they are dequantised like the rest. Tensors are
read by byte range (sharded_reader.py). Peak extra memory while loading: one MoE layer's stored expert bytes
(with expert parallelism: one block's experts in float, converted once its last tensor is read; ``load_parts_``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from flashtier.engine.model.checkpoint_reader import CheckpointError, CheckpointReader, StorageFormat
from flashtier.engine.model.dspark import dspark_skip
from flashtier.engine.model.engram import default_token_map
from flashtier.engine.model.engram_offload import TABLE_SUFFIX, attach_host_tables_, tables_to_host_, wants_host_tables
from flashtier.engine.model.engram_table import HostTable
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.fp8_linear import Fp8Linear
from flashtier.engine.model.loader import meta_model
from flashtier.engine.model.moe import MoE
from flashtier.engine.model.moe_convert import convert_experts_
from flashtier.engine.model.placement import quantize_linears_
from flashtier.engine.model.sharded_reader import StoredSlice, TensorSlice, locate, read_slices
from flashtier.engine.model.transformer import Transformer, weight_formats
from flashtier.kernels.quant.fp8_weight import as_e4m3fn, as_e8m0

_EXPERT = re.compile(r"^(?P<moe>.+\.ffn)\.(?:experts\.(?P<e>\d+)|shared_experts)\.(?P<w>w[123])\.weight$")


def place_in_formats_(model: Transformer, device: torch.device | str, *, host_engram: bool | None = None
                      ) -> Transformer:
    """Convert a float model in place: FP8 linears and the experts into their stored formats on ``device``,
    the Engram tables into host memory (``host_engram``: None = on for CUDA), then the rest moved there.
    Returns ``model``."""
    convert_experts_(model, device)
    _convert_sharded_experts_(model, device)
    quantize_linears_(model, device)
    if wants_host_tables(host_engram, device):
        tables_to_host_(model, device)
    return model.to(device)


def _convert_sharded_experts_(model: nn.Module, device: torch.device | str) -> int:
    """Put the experts of every module of ``model`` that converts its own (``convert_experts_(device)``: a
    sharded model's expert-parallel blocks) into their stored formats on ``device``, in place; returns the
    bytes now resident for them. Matched by the method's name: engine/model may not import engine/parallel.
    ``load_parts_`` converts the same blocks one by one as they complete (``BlockConversion``), so that both
    paths give the same modules, bit for bit.
    A module already converted is left as it is; ValueError (from the module) on unequal expert shapes."""
    return sum(module.convert_experts_(device) for module in list(model.modules())
               if callable(getattr(module, "convert_experts_", None)))


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter ``name`` of ``model`` (e.g. one still on "meta") by ``value``; mutates ``model``."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, nn.Parameter(value, requires_grad=False))


class BlockConversion:
    """Converts each module of ``model`` that converts its own experts (an expert-parallel block,
    ``convert_experts_(device)``) as soon as the last of its parameters among ``names`` is set: the float
    experts alive while a model is filled are one block's, not the rank's. Matched by the method's name
    (engine/model may not import engine/parallel); one per fill (``load_parts_``, rank_random.py)."""

    def __init__(self, model: nn.Module, names: Sequence[str], device: torch.device | str) -> None:
        self.device = device
        self.blocks = {f"{p}.": m for p, m in model.named_modules()
                       if p and callable(getattr(m, "convert_experts_", None))}
        self.unset = {p: sum(n.startswith(p) for n in names) for p in self.blocks}

    def tensor_set(self, name: str) -> None:
        """Count ``name`` as set; converts its block when it was the block's last (mutates the block; the
        block's ValueError on unequal expert shapes propagates)."""
        for prefix, block in self.blocks.items():
            if name.startswith(prefix):
                self.unset[prefix] -= 1
                if self.unset[prefix] == 0:
                    block.convert_experts_(self.device)


def _experts(moe: MoE, parts: dict[tuple[str, int], tuple], device) -> ExpertWeights:
    n = moe.gate.weight.shape[0]
    routed = {w: [parts[(w, e)] for e in range(n)] for w in ("w1", "w2", "w3")}
    shared = (parts[("w1", -1)], parts[("w3", -1)], parts[("w2", -1)])
    return ExpertWeights.from_packed(routed["w1"], routed["w3"], routed["w2"], shared, device)


def _table_layer(model: nn.Module, name: str) -> int:
    return model.get_submodule(name.removesuffix(".embed.weight")).layer


def _map_tables(model: Transformer, reader: CheckpointReader, names: list[str], register: bool
                ) -> dict[int, HostTable]:  # fmt: skip
    """The Engram tables ``names`` as shared read-only mappings of their checkpoint bytes (engram_table.py);
    a table not stored as fp8 rows is read and kept as it is stored."""
    tables = {}
    for name in names:
        plan = reader.plan(name)
        if plan.fmt is StorageFormat.FP8_ROWS:
            tables[_table_layer(model, name)] = HostTable.map_stored(
                locate(reader, plan.data), locate(reader, plan.scale), plan.shape, register=register)
        else:
            part = next(read_slices(reader, {name: plan.shape}, [name], {}, strict=False, progress=False))
            tables[_table_layer(model, name)] = HostTable.from_stored(part.data, None, pin=register)
    return tables


@torch.no_grad()
def load_parts_(
    model: Transformer, model_dir: str | Path, expected: Mapping[str, Sequence[int]],
    slices: Mapping[str, TensorSlice], device: str | torch.device, *, formats: bool, host_engram: bool | None,
    strict: bool, skip: tuple[str, ...] = (), progress: bool = True,
) -> Transformer:
    """Fill ``model`` (on the "meta" device; sharded or not) with its parameters' bytes of the checkpoint, read
    by byte range: ``slices[name]`` for a parameter holding part of a tensor, the whole tensor otherwise.

    ``expected``: logical name -> shape of the WHOLE model (validated against the headers first, see
    ``sharded_reader.read_slices``). With ``formats`` the weights take their stored formats on ``device``:
    FP8 linears outside the MoE become ``Fp8Linear`` from the stored codes, an unsharded ``MoE``'s experts one
    ``ExpertWeights`` from the stored MXFP4 / FP8 bytes; every other parameter is dequantised into the
    parameter's dtype. Sharded experts are read that way too; a module that converts its own experts (an
    expert-parallel block) does so on ``device`` as soon as its last tensor is set, exactly as
    ``place_in_formats_`` does (``convert_experts_``; the stored values are exact in the float dtype, so the
    re-quantisation gives the stored codes back): the load's transient is one block's float experts, not the
    rank's. Tensor-parallel experts stay float (their modules compute on float weights). The Engram tables, with ``host_engram`` (None = on for CUDA),
    are mapped from the files instead of read (``_map_tables``).
    Mutates and returns ``model`` (eval mode). Raises CheckpointError (a ValueError) before reading anything
    when the checkpoint does not match ``expected``, and ValueError when a tensor is left unset (a block with
    an unset tensor is never converted, so none can hide inside a converted module).
    """
    device, reader = torch.device(device), CheckpointReader(model_dir)
    wformats = weight_formats(model)
    params = dict(model.named_parameters())
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    pending: dict[str, dict[tuple[str, int], tuple]] = defaultdict(dict)
    host = wants_host_tables(host_engram, device)
    tables = [n for n in params if n.endswith(TABLE_SUFFIX)] if host else []
    wanted = [n for n in params if n not in tables]
    blocks = BlockConversion(model, wanted if formats else (), device)
    for part in read_slices(reader, expected, wanted, slices, strict=strict, skip=skip, progress=progress):
        _place(model, part, params, moes, pending, wformats, formats, device)
        if formats:
            blocks.tensor_set(part.name)
    if tables:
        attach_host_tables_(model, _map_tables(model, reader, tables, register=device.type == "cuda"), device,
                            params[tables[0]].dtype)
    model.token_map = default_token_map(model.cfg).to(device)
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left or pending:
        raise ValueError(f"{reader.directory}: the checkpoint left {len(left)} tensors unset (e.g. {left[:3]}) and "
                         f"{len(pending)} MoE layers incomplete")
    return model.eval()


def _place(model: Transformer, part: StoredSlice, params: dict[str, nn.Parameter], moes: dict[str, MoE],
           pending: dict[str, dict[tuple[str, int], tuple]], wformats: dict[str, str], formats: bool,
           device: torch.device) -> None:
    """Set one read tensor into ``model`` (``load_parts_``'s loop body; mutates ``model`` and ``pending``)."""
    name, want = part.name, tuple(params[part.name].shape)
    hit = _EXPERT.match(name)
    if formats and hit and hit["moe"] in moes:  # an unsharded MoE: its experts packed as stored
        data, scale = (t.to(device) for t in part.stored())
        parts = pending[hit["moe"]]
        parts[(hit["w"], int(hit["e"]) if hit["e"] is not None else -1)] = (data, scale)
        moe = moes[hit["moe"]]
        if len(parts) == 3 * moe.gate.weight.shape[0] + 3:
            moe.experts, moe.shared_experts = _experts(moe, parts, device), None
            del pending[hit["moe"]]
        return
    if formats and not hit and part.plan.fmt is StorageFormat.FP8 and wformats[name] == "fp8":
        data, scale = part.stored()
        if tuple(data.shape) != want:
            raise CheckpointError(f"{name}: read {list(data.shape)}, the model holds {list(want)}")
        owner, _, attr = name.removesuffix(".weight").rpartition(".")
        setattr(model.get_submodule(owner), attr, Fp8Linear(
            as_e4m3fn(data.to(device)), as_e8m0(scale.to(device)), compute_dtype=params[name].dtype))
        return
    # float32 first, then the parameter's dtype: what load_model does (exact for every stored format)
    value = part.values(torch.float32).to(params[name].dtype)
    if tuple(value.shape) != want:
        raise CheckpointError(f"{name}: read {list(value.shape)}, the model holds {list(want)}")
    set_parameter(model, name, value.to(device))


@torch.no_grad()
def load_model_in_formats(
    model_dir: str | Path, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
    with_dspark: bool = False, progress: bool = True, host_engram: bool | None = None,
) -> Transformer:
    """Stream ``model_dir`` (official layout) onto ``device`` in the stored formats; the Engram tables mapped
    from the files into host memory instead (``host_engram``: None = on for CUDA), never through the device.

    Raises CheckpointError (a ValueError) before reading anything when a tensor is missing or mis-shaped.
    """
    model_dir = Path(model_dir)
    model = meta_model(model_dir, dtype, with_dspark)
    expected = {k: tuple(v.shape) for k, v in model.named_parameters()}
    return load_parts_(model, model_dir, expected, {}, device, formats=True,
                       host_engram=host_engram, strict=with_dspark, skip=dspark_skip(with_dspark), progress=progress)
