"""Sharded loading by byte range (engine/model/sharded_reader.py, rank_engine.load_rank_model) on gloo.

The checkpoint: ``tiny`` with 32 routed experts and 4 output groups (``MANY_EXPERTS``: TP 2 and 4, EP 2 and
4 all fit), seeded random weights written by the project's writer (``save_model``). Every case forks one
process per rank (parallel_worker.fork_ranks); each rank

- loads its part by byte range (``load_rank_model``: the model planned on "meta", sharded, then only its
  slices' bytes read), and compares it with today's path, the whole checkpoint loaded and then sharded
  (``shard_model_(load_model(...))``, inherited from the test process): every parameter and buffer
  bit for bit (values, dtype, shape, signs of zeros);
- in the forward cases, runs prefill of a 40-token prompt plus DECODE_STEPS decode steps with the
  single-process incremental code; its logits must equal the one-process model's on the same tokens.

Tolerances against the one-process model (relative: max |a - b| / max |b|). float64: bit-identical (0.0;
the products of a split dot product are exact in float64, see test_parallel_forward.py). float32: the
split changes the summation order of the TP all-reduces, FP32_TOL = 1e-5 (measured 2.2e-7).

Weights in their stored formats (``formats=True``: FP8 linears as ``Fp8Linear``, the EP ranks' experts as
MXFP4 ``RankExperts``, the Engram tables mapped from the files: the CUDA path, run on the CPU), float32 and
bf16. The tight claim: the loaded rank model equals ``place_in_formats_`` of the whole-then-sharded model
(parameters, buffers, host tables, module classes) and its logits equal that model's, bit for bit. The
one-process reference is ``place_in_formats_`` of the whole model (the float model is no reference there:
in bf16 the placed model's logits differ from it by 1.5 relative on this tiny random model). float32:
greedy tokens equal and FP32_TOL (measured 2.2e-7). bf16: each rank's partial sums are rounded to bf16
before the all-reduce, and FP8 activation rounding and the top-k routing turn such differences into whole
code steps or another expert, so the logits move by up to 0.36 relative (measured: 1.4 absolute at the
prefill, logits up to 4.0; TP 2 alone: 0.10), more than the reference's top-1 margins (0.07 at the
prefill, 0.006 at decode step 2): greedy tokens do not hold and only the bound BF16_TOL = 0.5 is asserted
(it catches NaNs, zeros or a layer dropped; it does not tell a wrong slice from rounding, which the
bit-for-bit comparison and the float cases do).

The stored-formats load converts each expert-parallel block as soon as its last tensor is read: at every
conversion the float experts alive are that block's alone (with the conversion at the end of the load they
were all of the rank's blocks': the transient that made TP 8 overflow an 80 GB card, docs/memory_plan.md).

A deliberately broken load (rank 0 reads layer 3's query rows one head too far on) must be caught by both
the parameter comparison and the logits.
"""

import contextlib
import os
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import load_parts_, place_in_formats_
from flashtier.engine.model.dspark import dspark_skip
from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model import init as model_init
from flashtier.engine.model.init import random_model, random_model_on_device
from flashtier.engine.model.loader import load_model, meta_model, save_model
from flashtier.engine.model.sharded_reader import TensorSlice
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel import ParallelConfig, init_distributed, shard_model_, shutdown_distributed
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE
from flashtier.engine.parallel.rank_engine import load_rank_model
from flashtier.engine.parallel import rank_random
from flashtier.engine.parallel.rank_random import random_rank_model
from flashtier.engine.parallel.shard_model import rank_slices

from .conftest import random_prompt, rel_err
from .parallel_worker import Job, fork_ranks, free_port

# test_geometry_slice's three layers (encoder Full with the Engram table, decoder Full, decoder Reindex) at tiny
# width, with 32 routed experts, 4 output groups of one head and a short vocabulary (the checkpoint's bulk is
# then the experts, as in the real model)
MANY_EXPERTS = {
    "num_hidden_layers": 3, "compress_ratios": (2, 1, 1), "kv_source_layer_ids": (0, 1),
    "index_source_layer_ids": (0, 1, 2), "candidate_source_layer_id": 1, "engram_layer_ids": (1,),
    "dspark_target_layer_ids": (0, 1, 2), "n_routed_experts": 32, "o_groups": 4, "vocab_size": 8192,
    "name": "tiny-slice3-32e",
}
DECODE_STEPS = 3
FP32_TOL = 1e-5
BF16_TOL = 0.5
BROKEN_LAYER = 1
RANDOM_SEED = 23


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s bytes: equal views mean equal bits (signed zeros and NaNs included)."""
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])
    return t


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, plus the host Engram tables' codes and scales."""
    out = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for block in model.layers:
        host = block.engram.host if block.engram is not None else None
        if host is not None:
            table = host.tables[block.engram.layer]
            out[f"host_table.{block.engram.layer}.data"] = table.data
            if table.scale is not None:
                out[f"host_table.{block.engram.layer}.scale"] = table.scale
    return out


def differences(got: nn.Module, want: nn.Module) -> list[str]:
    """Names whose tensors differ in presence, dtype, shape or any bit, and modules whose class differs (equal
    classes and tensors: the two models compute the same, bit for bit)."""
    a, b = _tensors(got), _tensors(want)
    classes = [f"module {n}" for (n, m), (n2, m2) in zip(got.named_modules(), want.named_modules())
               if n != n2 or type(m) is not type(m2)]
    if len(list(got.modules())) != len(list(want.modules())):
        classes.append("module count")
    return classes + [n for n in sorted(set(a) | set(b))
                      if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                      or not torch.equal(_bits(a[n]), _bits(b[n]))]


def _broken_load(ckpt: Path, groups, dtype: torch.dtype) -> Transformer:
    """``load_rank_model`` with layer BROKEN_LAYER's wq_b rows read one head too far on."""
    model = meta_model(ckpt, dtype, False)
    expected = {k: tuple(v.shape) for k, v in model.named_parameters()}
    model = shard_model_(model, groups)
    slices = rank_slices(model)
    name = f"layers.{BROKEN_LAYER}.attn.wq_b.weight"
    cut, hd = slices[name], model.layers[BROKEN_LAYER].attn.head_dim
    slices[name] = TensorSlice(cut.axis, cut.start + hd, cut.size)  # rank 0: the first heads, so one more fits
    model = load_parts_(model, ckpt, expected, slices, "cpu", formats=False, host_engram=False, strict=False,
                        skip=dspark_skip(False), progress=False)
    return model.double() if dtype == torch.float64 else model


def _logits(model: Transformer, prompt: list[int], decode: list[int]) -> torch.Tensor:
    """Prefill of ``prompt`` then one decode step per token of ``decode``: logits [1 + len(decode), V]."""
    runner = IncrementalModel(model)
    state = runner.new_state()
    return torch.stack([runner.prefill(state, prompt)] + [runner.decode(state, t) for t in decode])

@contextlib.contextmanager
def _float_experts_at_conversion():
    """While active, each expert-parallel block's conversion records ``(bytes of float experts loaded in every
    block not yet converted, that block's own)``: the load's transient (one block's when blocks convert as they
    complete; every block's when they convert at the end)."""
    seen: list[tuple[int, int]] = []
    blocks: list[ExpertParallelMoE] = []  # every block made while active (shard_model_ makes the rank's)
    original, original_init = ExpertParallelMoE.convert_experts_, ExpertParallelMoE.__init__

    def registering(self: ExpertParallelMoE, *args, **kwargs):
        original_init(self, *args, **kwargs)
        blocks.append(self)

    def floats(block: ExpertParallelMoE) -> int:
        return 0 if block.converted else sum(p.numel() * p.element_size() for p in block.experts.parameters()
                                             if not p.is_meta)

    def recording(self: ExpertParallelMoE, device):
        if not self.converted:
            seen.append((sum(floats(b) for b in blocks), floats(self)))
        return original(self, device)

    ExpertParallelMoE.convert_experts_, ExpertParallelMoE.__init__ = recording, registering
    try:
        yield seen
    finally:
        ExpertParallelMoE.convert_experts_, ExpertParallelMoE.__init__ = original, original_init


def _rank(rank: int, whole: Transformer, ckpt: Path, mode: str, job: Job) -> dict:
    groups = init_distributed(job.parallel, rank, init_method=f"tcp://127.0.0.1:{job.port}", timeout_s=60)
    try:
        dtype = whole.embed.weight.dtype
        if mode == "random":  # the demo's path: only this rank's share drawn, tables shared per host
            tables = job.out_dir / "tables"
            with _float_experts_at_conversion() as seen:
                loaded = random_rank_model(whole.cfg, groups, "cpu", seed=RANDOM_SEED, dtype=dtype, host_engram=True,
                                           table_dir=tables)
            want = place_in_formats_(shard_model_(whole, groups), "cpu", host_engram=True)
            return {"differ": differences(loaded, want), "float_at_conversion": seen,
                    "left": sorted(p.name for p in tables.iterdir())}
        if job.fault == "broken" and rank == job.fault_rank:
            loaded = _broken_load(ckpt, groups, dtype)
        elif mode == "formats":
            with _float_experts_at_conversion() as seen:
                loaded = load_rank_model(ckpt, groups, torch.device("cpu"), dtype=dtype, formats=True,
                                         host_engram=True, progress=False)
        else:  # "float64" / "float": float weights, the CPU's reference path
            loaded = load_rank_model(ckpt, groups, torch.device("cpu"), dtype=dtype, progress=False)
        want = shard_model_(whole, groups)
        if mode == "formats":
            want = place_in_formats_(want, "cpu", host_engram=True)
        out = {"differ": differences(loaded, want)}
        if mode == "formats":
            out["float_at_conversion"] = seen
        if job.runs:
            prompt, decode = job.runs[groups.dp_rank]
            out["logits"] = _logits(loaded, prompt, decode)
            if mode != "float64":  # today's path through the same split, for a bit-for-bit comparison
                out["today"] = _logits(want, prompt, decode)
        return out

    finally:
        shutdown_distributed()


def rank_main(rank: int, whole: Transformer, ckpt: Path, mode: str, job: Job) -> None:
    """Child entry: ``{"differ": names, "logits": ...}`` to rank{R}.pt, or the traceback to rank{R}.err."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            torch.save(_rank(rank, whole, ckpt, mode, job), job.out_dir / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (job.out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


class Case:
    """The checkpoint, today's whole model of it in ``dtype`` (what the ranks shard) and the one-process
    reference: that model, or with ``formats`` a second copy put in its stored formats (``place_in_formats_``,
    what one process runs on the device), and the reference's greedy run (computed on demand)."""

    def __init__(self, ckpt: Path, dtype: torch.dtype, formats: bool = False):
        self.ckpt, self.dtype = ckpt, dtype
        self.whole = load_model(ckpt, dtype=dtype, progress=False, with_dspark=False)
        if dtype == torch.float64:
            self.whole = self.whole.double()
        self.reference = self.whole
        if formats:  # a copy: the ranks shard (and place) self.whole themselves
            self.reference = place_in_formats_(load_model(ckpt, dtype=dtype, progress=False, with_dspark=False),
                                               "cpu", host_engram=True)
        self._run: tuple | None = None

    def run(self) -> tuple[list[int], list[int], torch.Tensor]:
        """The reference's greedy run: (prompt, the decode steps' input tokens, logits [1 + DECODE_STEPS, V])."""
        if self._run is None:
            prompt = [t % MANY_EXPERTS["vocab_size"] for t in random_prompt(40, seed=41)]
            tokens, logits = greedy_generate(IncrementalModel(self.reference), prompt, 1 + DECODE_STEPS)
            self._run = (prompt, tokens[:-1], torch.stack(logits))
        return self._run

    def ranks(self, parallel: ParallelConfig, tmp: Path, mode: str = "float64", forward: bool = False,
              fault: str | None = None) -> list[dict]:
        runs = [self.run()[:2]] * parallel.data_parallel_size if forward else []
        job = Job(parallel, free_port(), runs, tmp, fault, 0)
        return fork_ranks(rank_main, (self.whole, self.ckpt, mode), job)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model = random_model(preset("tiny").replace(**MANY_EXPERTS), seed=11, with_dspark=False)
    return save_model(model, tmp_path_factory.mktemp("many_experts"))


@pytest.fixture(scope="module")
def cases(checkpoint):
    made: dict[tuple[torch.dtype, bool], Case] = {}

    def get(dtype: torch.dtype, formats: bool = False) -> Case:
        if (dtype, formats) not in made:
            made[(dtype, formats)] = Case(checkpoint, dtype, formats)
        return made[(dtype, formats)]

    return get


def _logit_errors(case: Case, results: list[dict]) -> list[float]:
    want = case.run()[2]
    errs = []
    for rank, got in enumerate(results):
        logits = got["logits"]
        assert logits.shape == want.shape and logits.dtype == want.dtype
        assert torch.argmax(logits, -1).tolist() == torch.argmax(want, -1).tolist(), f"rank {rank}: greedy differs"
        errs.append(rel_err(logits, want))
    return errs


SPLITS = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2_ep2": {"tensor_parallel_size": 2, "expert_parallel": True},
    "tp4": {"tensor_parallel_size": 4},
    "tp4_ep4": {"tensor_parallel_size": 4, "expert_parallel": True},
}


@pytest.mark.parametrize("split", ["tp2", "tp4"])
def test_byte_range_load_equals_whole_then_shard(split, cases, tmp_path):
    results = cases(torch.float64).ranks(ParallelConfig(**SPLITS[split]), tmp_path)
    assert [r["differ"] for r in results] == [[]] * len(results)


@pytest.mark.parametrize("split", ["tp2_ep2", "tp4_ep4"])
def test_float64_forward_is_bit_identical_to_one_process(split, cases, tmp_path):
    case = cases(torch.float64)
    results = case.ranks(ParallelConfig(**SPLITS[split]), tmp_path, forward=True)
    assert [r["differ"] for r in results] == [[]] * len(results)
    errs = _logit_errors(case, results)
    print(f"{split}: float64 relative error per rank {errs}")
    assert max(errs) == 0.0


def test_float32_forward_within_tolerance(cases, tmp_path):
    case = cases(torch.float32)
    results = case.ranks(ParallelConfig(**SPLITS["tp2_ep2"]), tmp_path, mode="float", forward=True)
    assert [r["differ"] for r in results] == [[]] * len(results)
    assert all(_same(r["logits"], r["today"]) for r in results)
    errs = _logit_errors(case, results)
    print(f"tp2_ep2: float32 relative error per rank {errs}")
    assert max(errs) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_stored_formats_equal_placement_and_forward_within_tolerance(dtype, cases, tmp_path):
    case = cases(dtype, formats=True)  # the reference: the one-process model, placed in its stored formats
    results = case.ranks(ParallelConfig(**SPLITS["tp2_ep2"]), tmp_path, mode="formats", forward=True)
    assert [r["differ"] for r in results] == [[]] * len(results)
    assert all(_same(r["logits"], r["today"]) for r in results)
    for r in results:  # each block converted as it completed: no other block's float experts alive then
        assert len(r["float_at_conversion"]) == 3 and all(total == own > 0 for total, own in
                                                          r["float_at_conversion"]), r["float_at_conversion"]
    if dtype == torch.float32:
        errs = _logit_errors(case, results)  # greedy tokens equal too
        print(f"tp2_ep2: float32 stored formats relative error per rank {errs}")
        assert max(errs) <= FP32_TOL
        return
    # bf16: the split's roundings move logits by more than the reference's top-1 margins (module docstring),
    # so only a bound holds against one process; greedy is not asserted
    errs = [rel_err(r["logits"], case.run()[2]) for r in results]
    print(f"tp2_ep2: bf16 stored formats relative error per rank {errs}")
    assert max(errs) <= BF16_TOL


def test_a_broken_load_is_caught(cases, tmp_path):
    case = cases(torch.float64)
    results = case.ranks(ParallelConfig(**SPLITS["tp2_ep2"]), tmp_path, forward=True, fault="broken")
    assert results[0]["differ"] == [f"layers.{BROKEN_LAYER}.attn.wq_b.weight"] and results[1]["differ"] == []
    errs = [rel_err(r["logits"], case.run()[2]) for r in results]
    print(f"broken: relative error per rank {errs}")
    assert min(errs) > 1e-6  # the attention all-reduce carries rank 0's wrong heads to every rank


@pytest.mark.parametrize(("split", "dtype"), [("tp2_ep2", torch.bfloat16), ("tp2", torch.float32)])
def test_a_rank_draws_its_share_of_the_one_process_demo_model(split, dtype, tmp_path, monkeypatch):
    """The demo's weights at TP > 1 on CUDA (run here on the CPU): each rank draws only its share
    (``random_rank_model``), which equals the one-process ``random_model_on_device`` sharded and placed, bit for
    bit (parameters, buffers, the mapped host tables, module classes); the EP blocks convert as they complete;
    the table files are gone once every rank mapped them. The table chunks are cut to 256 rows here (in both
    draws), so that both ranks fill some of the shared table."""
    for module in (model_init, rank_random):
        monkeypatch.setattr(module, "TABLE_CHUNK_ROWS", 256)
    cfg = preset("tiny").replace(**MANY_EXPERTS)
    whole = random_model_on_device(cfg, "cpu", seed=RANDOM_SEED, dtype=dtype, with_dspark=False, host_engram=False)
    (tmp_path / "tables").mkdir()
    job = Job(ParallelConfig(**SPLITS[split]), free_port(), [], tmp_path)
    results = fork_ranks(rank_main, (whole, None, "random"), job)
    assert [r["differ"] for r in results] == [[]] * len(results)
    assert [r["left"] for r in results] == [[]] * len(results)
    for r in results:
        floats = r["float_at_conversion"]
        assert all(total == own > 0 for total, own in floats) and len(floats) == (3 if split == "tp2_ep2" else 0)
