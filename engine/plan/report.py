"""A ``MemoryPlan`` as text (a table an operator reads) or as a JSON-ready dict (every row, every rank)."""

from __future__ import annotations

from dataclasses import asdict

from flashtier.engine.plan.memory_plan import MemoryPlan, PlanMisfit, RankPlan
from flashtier.kvstore.config import GiB


def _gib(n: int) -> str:
    return f"{n / GiB:10.2f}"


def _rank_lines(rank: RankPlan, of: int, card: int | None) -> list[str]:
    where = f"per GPU ({rank.device}, the fullest of {of})" if rank.device != "cpu" else f"per rank process ({of})"
    lines = [f"{where:<34}{'GiB':>10}  basis"]
    for row in rank.rows:
        mark = "~" if row.estimate else " "
        lines.append(f"  {row.label:<32}{_gib(row.nbytes)} {mark}{row.basis}")
    lines.append(f"  {'total serving':<32}{_gib(rank.total)}")
    lines.append(f"  {'peak while loading':<32}{_gib(rank.load_peak)}  {rank.load_basis}")
    if card is not None and rank.device != "cpu":
        verdict = "fits" if rank.need <= card else "DOES NOT FIT"
        lines.append(f"  {'card':<32}{_gib(card)}  {verdict} ({(card - rank.need) / GiB:+.2f} GiB)")
    return lines


def plan_table(plan: MemoryPlan, misfit: PlanMisfit | None = None, host_memory: int | None = None) -> str:
    """The plan as lines of text: the header, the fullest rank, the host, the notes and the verdict.

    ``~`` marks an estimate (its basis says how it was reached); other rows count the layout's bytes."""
    split = f"--tensor-parallel-size {plan.tensor_parallel_size}" + (" --expert-parallel" if plan.expert_parallel
                                                                     else "")
    lines = [f"memory plan: {plan.model} ({plan.source}), {plan.device_type} {plan.dtype}, {split}",
             f"KV pool: {plan.num_blocks:,} blocks x {plan.block_bytes:,} B ({plan.block_size} tokens; "
             f"{plan.pool_basis}) = {plan.kv_tokens:,} tokens; max model len {plan.max_model_len:,}",
             f"GPU weights over all ranks: {plan.weights_total / GiB:.2f} GiB ({plan.weights_total / 1e9:.1f} GB)", ""]
    lines += _rank_lines(plan.busiest(), len(plan.ranks), plan.gpu_memory)
    lines += ["", f"{'per host':<34}{'GiB':>10}  basis"]
    for row in plan.host.rows:
        lines.append(f"  {row.label:<32}{_gib(row.nbytes)} {'~' if row.estimate else ' '}{row.basis}")
    lines.append(f"  {'total serving':<32}{_gib(plan.host.total)}")
    lines.append(f"  {'peak while loading':<32}{_gib(plan.host.load_peak)}  {plan.host.load_basis}")
    if host_memory is not None:
        verdict = "fits" if plan.host.need <= host_memory else "DOES NOT FIT"
        lines.append(f"  {'available':<32}{_gib(host_memory)}  {verdict}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    lines.append("~ = estimate (its basis is stated); other rows are byte counts of the layout")
    if misfit is not None:
        lines.append(f"does not fit: {misfit.flag} {misfit.value}: {misfit.problem}; {misfit.fix}")
    return "\n".join(lines)


def plan_dict(plan: MemoryPlan, misfit: PlanMisfit | None = None, host_memory: int | None = None) -> dict:
    """Every field of the plan (all ranks) plus the totals and the verdict, for ``--json``."""
    out = asdict(plan)
    out["kv_tokens"] = plan.kv_tokens
    out["weights_total"] = plan.weights_total
    for rank, row in zip(plan.ranks, out["ranks"]):
        row.update(total=rank.total, weights=rank.weights, need=rank.need)
    out["host"].update(total=plan.host.total, need=plan.host.need, available=host_memory)
    out["fits"] = misfit is None
    out["misfit"] = None if misfit is None else asdict(misfit)
    return out
