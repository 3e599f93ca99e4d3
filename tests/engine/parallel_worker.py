"""Ranks of the parallel tests: forked children of the test process, started by ``fork_ranks``.

Fork, not spawn: a child inherits the test's unsharded float64 model, so no rank imports torch again or
rebuilds the model (on 2 shared cores that costs more than the forward). Each child joins the gloo group
over tcp on 127.0.0.1 and saves its result to ``OUT_DIR/rank{R}.pt``, or its traceback to
``OUT_DIR/rank{R}.err``.

``rank_main`` shards its copy with ``shard_model_`` and runs prefill of its data-parallel replica's
prompt plus the decode steps with the single-process incremental code: logits [1 + steps, V]. Faults,
on the job's fault rank only (every collective is still made):

- ``skip_allreduce``: the attention of layer FAULT_LAYER keeps its own partial sum instead of the sum;
- ``head_off_by_one``: that layer's query heads (wq_b rows and sinks) are taken one head too far on.

``moe_rank_main`` runs one ``ExpertParallelMoE`` on its replica's rows (possibly none);
``moe_ep_variants_main`` runs it in each expert form (float, stored MXFP4 through the grouped op's reference
and its kernels), records the ``expert_ids`` of every grouped-op call, then drops one expert (the broken case);
``moe_tp_forms_main`` runs it on a TP group that is also the EP group in both of its forms (all-reduce of pairs,
all-to-all dispatch).
"""

import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flashtier.engine.model.incremental import IncrementalModel
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel import GroupComm, ParallelConfig, init_distributed, shard_model_, shutdown_distributed
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE

FAULT_LAYER = 3


@dataclass(frozen=True)
class Job:
    parallel: ParallelConfig
    port: int
    runs: list[tuple[list[int], list[int]]]  # per DP replica: (prompt, tokens fed to the decode steps)
    out_dir: Path
    fault: str | None = None
    fault_rank: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_ranks(target, args: tuple, job: Job, timeout_s: float = 90.0) -> list[torch.Tensor]:
    """Fork one child per rank running ``target(rank, *args, job)`` and return each rank's saved tensor.

    A child that fails, or a run that outlives ``timeout_s`` (its children are killed), fails the caller
    with the children's tracebacks.
    """
    ctx = mp.get_context("fork")  # the children inherit the built model: no import or build per rank
    procs = [ctx.Process(target=target, args=(r, *args, job)) for r in range(job.parallel.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out = job.out_dir
    errs = {r: out / f"rank{r}.err" for r in range(len(procs))}
    errors = {r: e.read_text()[-2000:] for r, e in errs.items() if e.exists()}
    codes = [p.exitcode for p in procs]
    assert not errors and codes == [0] * len(procs), f"ranks failed (exit codes {codes}): {errors}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(len(procs))]


class KeepsOwnPartial(GroupComm):
    """Takes part in the all-reduce (so the other ranks do not wait) but returns its own partial sum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        own = x.clone()
        super().all_reduce(x)
        return own


def _inject(model: Transformer, fault: str, full_attn: dict[str, torch.Tensor]) -> None:
    attn = model.layers[FAULT_LAYER].attn
    if fault == "skip_allreduce":
        c = attn.tp_comm
        attn.tp_comm = KeepsOwnPartial(c.ranks, c.rank, c.group)
    elif fault == "head_off_by_one":
        hd, first = attn.head_dim, attn.head_shard.head_start + 1
        heads = slice(first, first + attn.n_heads)
        attn.wq_b.weight.copy_(full_attn["wq_b"][heads.start * hd : heads.stop * hd])
        attn.attn_sink.copy_(full_attn["attn_sink"][heads])
    else:
        raise ValueError(f"unknown fault {fault!r}")


@torch.no_grad()
def _run(rank: int, model: Transformer, job: Job) -> torch.Tensor:
    groups = init_distributed(job.parallel, rank, init_method=f"tcp://127.0.0.1:{job.port}", timeout_s=60)
    try:
        attn = model.layers[FAULT_LAYER].attn
        full_attn = {"wq_b": attn.wq_b.weight.clone(), "attn_sink": attn.attn_sink.clone()}
        shard_model_(model, groups)
        if job.fault and rank == job.fault_rank:
            _inject(model, job.fault, full_attn)
        prompt, decode = job.runs[groups.dp_rank]
        runner = IncrementalModel(model)
        state = runner.new_state()
        logits = [runner.prefill(state, prompt)]
        for token in decode:
            logits.append(runner.decode(state, token))
        return torch.stack(logits)
    finally:
        shutdown_distributed()


def rank_main(rank: int, model: Transformer, job: Job) -> None:
    """Child entry of the forward tests: logits to rank{R}.pt, or the traceback to rank{R}.err."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds to loopback, whatever the host name resolves to
    torch.set_num_threads(1)
    try:
        torch.save(_run(rank, model, job), job.out_dir / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (job.out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _in_group(rank: int, job: Job, compute) -> None:
    """A child's life in the job's process group: join it (gloo on loopback, one torch thread), save
    ``compute(groups)`` (under no_grad) to ``OUT_DIR/rank{R}.pt``, leave the group; a failure's traceback goes
    to ``rank{R}.err`` (as in ``rank_main``) and is raised again."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        groups = init_distributed(job.parallel, rank, init_method=f"tcp://127.0.0.1:{job.port}", timeout_s=60)
        try:
            with torch.no_grad():
                out = compute(groups)
            torch.save(out, job.out_dir / f"rank{rank}.pt")
        finally:
            shutdown_distributed()
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (job.out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def moe_rank_main(rank: int, moe: torch.nn.Module, xs: list[torch.Tensor], job: Job) -> None:
    """Child entry of the MoE-only test: ``ExpertParallelMoE`` of ``moe`` on this DP replica's rows
    ``xs[dp_rank]`` (possibly none); saves the output to ``OUT_DIR/rank{R}.pt`` (errors as in ``rank_main``)."""
    _in_group(rank, job, lambda groups: ExpertParallelMoE(moe, groups.tp, groups.ep)(xs[groups.dp_rank]))


def _ep_variants(groups, moe: torch.nn.Module, x: torch.Tensor, drop_expert: int) -> dict[str, torch.Tensor]:
    """This rank's ``ExpertParallelMoE`` outputs on rows ``x`` in each expert form, and the ``expert_ids`` each
    grouped-op call got; then the same with ``drop_expert`` removed from its owner's experts (the broken case)."""
    import copy

    from flashtier.engine.parallel import expert_parallel_moe as epm

    calls: list[torch.Tensor] = []
    real_op = epm.moe_grouped_ffn

    def spy(*args, **kwargs):
        calls.append(kwargs["expert_ids"].clone())
        return real_op(*args, **kwargs)

    epm.moe_grouped_ffn = spy  # a forked child: patches this rank's process only
    moe32 = copy.deepcopy(moe).float()
    x64, x32 = x.double(), x.float()
    flt64 = ExpertParallelMoE(moe, groups.tp, groups.ep)
    flt32 = ExpertParallelMoE(moe32, groups.tp, groups.ep)
    stored = ExpertParallelMoE(moe, groups.tp, groups.ep)  # the shared expert stays float: float64 here
    stored32 = ExpertParallelMoE(moe32, groups.tp, groups.ep)
    stored.convert_experts_("cpu")
    out = {"float64": flt64(x64), "float32": flt32(x32), "nbytes": torch.tensor(stored.experts.nbytes)}
    out["stored64"] = stored(x64)  # "auto" on the CPU: the op's reference path
    stored32.convert_experts_("cpu")
    stored32.experts.impl = "triton"  # the kernels, interpreted
    out["stored32"] = stored32(x32)
    out["ids"] = torch.stack(calls) if calls else torch.zeros(0, 0, dtype=torch.int64)
    if str(drop_expert) in flt64.experts:
        del flt64.experts[str(drop_expert)]
        rx = stored.experts
        keep = (rx.expert_ids != drop_expert).nonzero()[:, 0]
        for name in ("w13_codes", "w13_scales", "w2_codes", "w2_scales", "expert_ids"):
            setattr(rx, name, getattr(rx, name)[keep])
    out["float64_broken"], out["stored64_broken"] = flt64(x64), stored(x64)
    return out


def moe_ep_variants_main(rank: int, moe: torch.nn.Module, xs: list[torch.Tensor], drop_expert: int, job: Job) -> None:
    """Child entry of the grouped-op EP tests: ``_ep_variants`` on this DP replica's rows ``xs[dp_rank]``, saved
    as a dict to ``OUT_DIR/rank{R}.pt`` (errors as in ``rank_main``)."""
    _in_group(rank, job, lambda groups: _ep_variants(groups, moe, xs[groups.dp_rank], drop_expert))


def _tp_forms(groups, moe: torch.nn.Module, x: torch.Tensor, drop_expert: int) -> dict[str, torch.Tensor]:
    """On a TP group that is also the EP group: ``ExpertParallelMoE`` on the same rows ``x`` in both forms
    (``reduced``: the all-reduce of pairs; ``all_to_all``: the dispatch, forced by ``max_reduced_pairs = 0``),
    for float64 float and stored experts and fp32 stored experts through the kernels (interpreted), with the
    all-to-all calls each form made; then the reduced float64 form without ``drop_expert`` (the broken case)."""
    import copy

    ep = groups.ep
    real_a2a = ep.all_to_all
    a2a_calls = [0]

    def counted(*args, **kwargs):
        a2a_calls[0] += 1
        return real_a2a(*args, **kwargs)

    ep.all_to_all = counted  # this rank's group object only
    moe32 = copy.deepcopy(moe).float()
    out = {}
    for form, max_pairs in (("reduced", None), ("all_to_all", 0)):
        flt = ExpertParallelMoE(moe, groups.tp, ep)
        stored = ExpertParallelMoE(moe, groups.tp, ep)
        stored.convert_experts_("cpu")
        stored32 = ExpertParallelMoE(moe32, groups.tp, ep)
        stored32.convert_experts_("cpu")
        stored32.experts.impl = "triton"
        blocks = (flt, stored, stored32)
        if max_pairs is not None:
            for block in blocks:
                block.max_reduced_pairs = max_pairs
        assert all(block.reduces_pairs(x.shape[0]) is (max_pairs is None) for block in blocks)
        a2a_calls[0] = 0
        out[f"{form}64"], out[f"{form}_stored64"] = flt(x.double()), stored(x.double())
        out[f"{form}_stored32"] = stored32(x.float())
        out[f"{form}_a2a_calls"] = torch.tensor(a2a_calls[0])
    broken = ExpertParallelMoE(moe, groups.tp, ep)
    if str(drop_expert) in broken.experts:
        del broken.experts[str(drop_expert)]
    out["reduced64_broken"] = broken(x.double())
    return out


def moe_tp_forms_main(rank: int, moe: torch.nn.Module, x: torch.Tensor, drop_expert: int, job: Job) -> None:
    """Child entry of the TP-group EP tests: ``_tp_forms`` on the replicated rows ``x``, saved as a dict to
    ``OUT_DIR/rank{R}.pt`` (errors as in ``rank_main``)."""
    _in_group(rank, job, lambda groups: _tp_forms(groups, moe, x, drop_expert))
