"""The memory plan (engine/plan) against what the engine really holds: the model's own tensors, a checkpoint the
project's writer wrote, and the tensors left on each rank by both ways a rank gets its model: the demo's
(``shard_model_`` then ``place_in_formats_``) and a checkpoint's (``load_rank_model``: read by byte range, the
expert-parallel blocks converted, the Engram tables mapped from the files).

Every comparison is exact (bytes): the plan's weight rows count the layout, not an estimate. A deliberately
wrong plan (the other split's residency) must not match.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import place_in_formats_
from flashtier.engine.model.init import random_model
from flashtier.engine.model.loader import save_model
from flashtier.engine.model.transformer import Transformer, weight_formats
from flashtier.engine.parallel import GroupComm, ParallelConfig, ParallelGroups, shard_model_
from flashtier.engine.parallel.rank_engine import load_rank_model
from flashtier.engine.plan.inventory import Part, inventory_from_checkpoint, inventory_from_config
from flashtier.engine.plan.memory_plan import PlanInputs, build_plan, check_fit, pinned_bytes, rank_weights
from flashtier.kvstore.config import GiB, KVStoreConfig

CPU = EngineConfig(device="cpu", dtype="float32")
GPU = EngineConfig(device="cuda", dtype="bfloat16")  # planned only: the residency rules of a CUDA run
# the tiny preset with an expert width of 64: under TP 2 the shared expert's slice is 32 rows, whole FP8 blocks
WIDE = {"moe_intermediate_size": 64, "name": "tiny-wide"}


def _groups(par: ParallelConfig, rank: int) -> ParallelGroups:
    """A rank's groups without a process group (sharding runs no collective; a stand-in object is enough)."""
    world = tuple(range(par.world_size))
    tp = par.tensor_parallel_size
    tp_ranks = tuple(range(rank - rank % tp, rank - rank % tp + tp))
    ep_ranks = world if par.expert_parallel else (rank,)
    return ParallelGroups(par, rank, GroupComm(tp_ranks, rank, object()), GroupComm(ep_ranks, rank, object()))


def _resident(model: Transformer) -> int:
    """Bytes of every tensor the model keeps: parameters and buffers, non-persistent ones too (the converted experts'
    codes and scales), the Engram token map left out (not a weight)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in tensors if not name.endswith("token_map"))


@pytest.mark.parametrize("geometry", ["tiny", "v4.1-geometry"])
@pytest.mark.parametrize("dspark", [False, True], ids=["backbone", "dspark"])
def test_inventory_is_the_models_tensor_list(geometry, dspark):
    """Names, formats and shapes equal the model's state_dict and weight_formats (built on the meta device)."""
    cfg = preset("tiny") if geometry == "tiny" else preset("v4.1-flash").replace(n_routed_experts=4,
                                                                                dspark_n_routed_experts=2)
    with torch.device("meta"):
        model = Transformer(cfg, dtype=torch.bfloat16, with_dspark=dspark)
    formats = weight_formats(model)
    want = {n: (formats[n], tuple(t.shape)) for n, t in model.state_dict().items()}
    got = {t.name: (t.fmt.value, t.shape) for t in inventory_from_config(cfg, with_dspark=dspark).tensors}
    assert got == want


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The tiny preset written by the project's writer (random weights snapped to their formats)."""
    directory = tmp_path_factory.mktemp("tiny-ckpt")
    save_model(random_model(preset("tiny"), seed=0, with_dspark=True), directory)
    return directory


@pytest.mark.parametrize("case", ["exact", "broken"])
def test_preset_plan_equals_the_checkpoint_plan(tiny_checkpoint, case):
    """The headers' inventory equals the preset's tensor for tensor, and both equal the bytes the writer stored
    (its index's total_size). ``broken``: a preset with one more expert per layer must not match."""
    cfg = preset("tiny") if case == "exact" else preset("tiny").replace(n_routed_experts=9)
    from_preset = inventory_from_config(cfg, with_dspark=True)
    from_disk = inventory_from_checkpoint(tiny_checkpoint, with_dspark=True)
    written = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    key = sorted((t.name, t.fmt, t.shape, t.nbytes) for t in from_preset.tensors)
    same = key == sorted((t.name, t.fmt, t.shape, t.nbytes) for t in from_disk.tensors)
    assert from_disk.nbytes == written
    assert same == (case == "exact")
    assert (from_preset.nbytes == written) == (case == "exact")
    if case == "exact":  # and so the plans: every rank, every row
        par = ParallelConfig(2, True)
        kv = KVStoreConfig(num_blocks=64)
        plans = [build_plan(PlanInputs(inv, GPU, kv, par, gpu_memory=80 * GiB)) for inv in (from_preset, from_disk)]
        assert plans[0].ranks == plans[1].ranks and plans[0].host == plans[1].host


@pytest.fixture(scope="module")
def tiny_models():
    """The tiny model in both parameter dtypes, built once (each rank shards its own deep copy)."""
    return {d: random_model(preset("tiny"), seed=0, dtype=d, with_dspark=False) for d in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("split", [(1, False), (2, False), (2, True)], ids=lambda s: f"tp{s[0]}-ep{s[1]}")
@pytest.mark.parametrize("engine", [CPU, GPU], ids=["cpu-float", "cuda-formats"])
def test_rank_weights_equal_the_sharded_models_tensors(tiny_models, split, engine):
    """Oracle: the tiny model sharded by ``shard_model_`` for each rank and put in its resident form
    (``place_in_formats_`` for a CUDA run, on the CPU here; float for a CPU run): the bytes of what it keeps
    equal the plan's weights of that rank, and its host Engram tables the plan's table bytes."""
    tp, ep = split
    par = ParallelConfig(tp, ep)
    cfg = preset("tiny")
    inv = inventory_from_config(cfg)
    dtype = torch.bfloat16 if engine is GPU else torch.float32
    for rank in range(par.world_size):
        model = copy.deepcopy(tiny_models[dtype])
        if par.world_size > 1:
            shard_model_(model, _groups(par, rank))
        if engine is GPU:
            place_in_formats_(model, "cpu", host_engram=True)
        planned = rank_weights(inv, engine, par, rank)
        assert sum(planned.values()) == _resident(model), f"rank {rank}"
        if engine is GPU:
            host = model.layers[cfg.engram_layer_ids[0]].engram.host
            tables = sum(t.nbytes for t in inv.tensors if t.part == Part.ENGRAM_TABLE)
            assert host.nbytes == tables and planned[Part.ENGRAM_TABLE] == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny preset (expert width 32) and WIDE (64) written by the project's writer, with bf16 inventories."""
    out = {}
    for label, cfg in (("tiny", preset("tiny")), ("wide", preset("tiny").replace(**WIDE))):
        directory = tmp_path_factory.mktemp(f"{label}-ckpt")
        save_model(random_model(cfg, seed=1, dtype=torch.bfloat16, with_dspark=False), directory)
        out[label] = (directory, inventory_from_config(cfg))
    return out


@pytest.mark.parametrize("case", ["exact", "broken"])
@pytest.mark.parametrize("split", [(2, True), (2, False)], ids=lambda s: f"tp{s[0]}-ep{s[1]}")
@pytest.mark.parametrize("width", ["tiny", "wide"])
def test_checkpoint_rank_weights_equal_the_loaded_ranks_tensors(checkpoints, width, split, case):
    """Oracle: each rank's part of a checkpoint as ``load_rank_model`` leaves it in the CUDA formats (run on the
    CPU): read by byte range, FP8 linears as stored, under EP the rank's experts converted by their blocks (MXFP4,
    and the shared slice in FP8 when it is whole 32-blocks: ``wide``; float at 16 rows: ``tiny``), under TP
    without EP float slices, the Engram tables mapped from the files. Its bytes equal the plan's weights of that
    rank, and the mapped tables the plan's one host copy. ``broken``: the plan of the other split (EP on / off)
    must not match."""
    directory, inv = checkpoints[width]
    tp, ep = split
    par = ParallelConfig(tp, ep)
    engine = dataclasses.replace(GPU, model_dir=str(directory))
    planned_par = par if case == "exact" else ParallelConfig(tp, not ep)
    plan = build_plan(PlanInputs(inv, engine, KVStoreConfig(num_blocks=8), par, gpu_memory=80 * GiB))
    for rank in range(par.world_size):
        model = load_rank_model(directory, _groups(par, rank), torch.device("cpu"), dtype=torch.bfloat16,
                                formats=True, host_engram=True, progress=False)
        planned = rank_weights(inv, engine, planned_par, rank)
        assert (sum(planned.values()) == _resident(model)) == (case == "exact"), f"rank {rank}"
        host = model.layers[inv.config.engram_layer_ids[0]].engram.host
        assert host.nbytes == plan.host.rows[0].nbytes  # one mapped copy for every rank of the host
    shared = plan.ranks[0].row(Part.SHARED).basis
    assert shared.startswith("fp8" if ep and width == "wide" else "float"), shared


@pytest.mark.parametrize("split", [(2, False), (4, True), (8, True)], ids=lambda s: f"tp{s[0]}-ep{s[1]}")
def test_splits_sum_to_the_whole(split):
    """Over the ranks, the split parts add up to the whole model (float residency: bytes = numel x dtype);
    replicated parts count once per rank."""
    cfg = preset("v4.1-flash").replace(n_routed_experts=16, dspark_n_routed_experts=16)
    inv = inventory_from_config(cfg)
    par = ParallelConfig(*split)
    whole = rank_weights(inv, CPU, ParallelConfig(), 0)
    ranks = [rank_weights(inv, CPU, par, r) for r in range(par.world_size)]
    for part in (Part.ROUTED, Part.SHARED, Part.VOCAB):
        assert sum(r[part] for r in ranks) == whole[part], part
    assert all(r[Part.OTHER] == whole[Part.OTHER] for r in ranks)


def test_v41_flash_totals():
    """V4.1-Flash on one CUDA rank: routed experts 40 x 384 x 3 MXFP4 matrices (288.8 GB), the dense rest ~9.9 GB,
    the Engram tables 2 x ~101 GB in fp8 rows (model.md §2.1: 289 GB experts, 2 x 98-101 GB tables)."""
    inv = inventory_from_config(preset("v4.1-flash"))
    w = rank_weights(inv, GPU, ParallelConfig(), 0)
    assert w[Part.ROUTED] == 40 * 384 * 3 * (2304 * 5120 // 2 + 2304 * 5120 // 32)
    dense = sum(v for k, v in w.items() if k != Part.ROUTED)
    assert 9.5e9 < dense < 10.5e9
    tables = [t for t in inv.tensors if t.part == Part.ENGRAM_TABLE]
    assert [t.shape[0] for t in tables] == [384006168, 384016682]  # config.json's engram_num_embeddings
    assert sum(t.nbytes for t in tables) == sum(r * (256 + 8) for r in (384006168, 384016682))


def test_pinned_rounding():
    assert [pinned_bytes(n) for n in (0, 1, 3, 4, 5, 98_304_299_008)] == [0, 1, 4, 4, 8, 128 * GiB]


@pytest.mark.parametrize("margin", [0, -1], ids=["exactly-fits", "one-byte-short"])
def test_check_fit_boundary(margin):
    """A card of exactly the plan's need fits; one byte less is refused, naming --num-blocks for an explicit pool."""
    inv = inventory_from_config(preset("tiny"))
    inputs = PlanInputs(inv, GPU, KVStoreConfig(num_blocks=1000), ParallelConfig(), gpu_memory=None)
    plan = build_plan(inputs)
    need = plan.ranks[0].need
    misfit = check_fit(plan, inputs, gpu_memory=(need + margin,))
    if margin == 0:
        assert misfit is None
    else:
        assert misfit.flag == "--num-blocks" and misfit.need == need and misfit.have == need - 1


def test_automatic_pool_takes_the_utilised_share_of_what_is_left():
    """No --num-blocks: utilisation x (card - weights - runtime), in whole blocks, as KVStoreConfig.pool_blocks."""
    inv = inventory_from_config(preset("tiny"))
    card = 8 * GiB
    plan = build_plan(PlanInputs(inv, GPU, KVStoreConfig(hbm_utilization=0.5), ParallelConfig(), gpu_memory=card))
    rank = plan.ranks[0]
    fixed = rank.weights + sum(r.nbytes for r in rank.rows if r.label in ("CUDA runtime", "engram gather buffers"))
    assert plan.num_blocks == int((card - fixed) * 0.5) // plan.block_bytes
    assert math.isclose(plan.ranks[0].row("KV pool").nbytes, (card - fixed) * 0.5, rel_tol=1e-3)
